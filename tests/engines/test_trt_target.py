"""The `trt` export target, run end to end on the CPU emulation (runtime/backends/emulate.py).

The plugin node is served by the numpy reference (the emulate backend's option emulation="reference")
for every family and by the Triton kernel under the interpreter (the default) for two; both against
Hugging Face eager.
Stated tolerance (fp32): max abs logit error <= 1e-3 per step and exact greedy agreement for 32 new
tokens, teacher-forced and via HF's own generate().
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("onnxruntime_extensions")
onnx = pytest.importorskip("onnx")

from shared_exports import every_family  # noqa: E402

from kvforge.cli import main  # noqa: E402
from kvforge.core.contract import PLUGIN  # noqa: E402
from kvforge.core.errors import BackendUnavailableError, InputError, UnsupportedModelError  # noqa: E402
from kvforge.exporter.export import export_model  # noqa: E402
from kvforge.models.recipes import FAMILY_RECIPES  # noqa: E402  (every family, through the numpy reference)
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.backends import emulate  # noqa: E402
from kvforge.runtime.drivers import inspection  # noqa: E402
from kvforge.tools.parity import run_parity  # noqa: E402

ATOL_FP32 = 1e-3
REFERENCE = {"emulation": "reference"}  # the emulate backend's option: the numpy reference serves the plugin


def _spy(monkeypatch, module, name: str) -> list:
    """Record each call of module.<name> (which still runs): which implementation served the plugin."""
    calls: list = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _implementations(monkeypatch) -> dict[str, list]:
    from kvforge.plugins import numpy_reference, triton_attention

    return {"reference": _spy(monkeypatch, numpy_reference, "kv_cache_attention_"),
            "triton": _spy(monkeypatch, triton_attention, "kv_cache_attention_triton")}


def _assert_parity(report) -> None:
    for prompt in report.prompts:
        assert len(prompt.export_tokens) == 32
        assert prompt.max_abs_err <= ATOL_FP32, prompt.step_max_abs_err
        assert prompt.mismatched_steps == [] and prompt.tie_steps == []
        assert prompt.generate_equal
    assert report.passed, report.summary()


def test_the_plugin_node_replaces_attention_once_per_layer(exported) -> None:
    folder = exported("qwen3-tiny", "trt")
    manifest = json.loads((folder / "kvforge.json").read_text())
    for phase in ("prefill", "decode"):
        graph = onnx.load(folder / f"{phase}.onnx", load_external_data=False).graph
        nodes = [n for n in graph.node if n.op_type == PLUGIN.name]
        assert len(nodes) == manifest["kv_cache"]["num_layers"]
        assert {n.domain for n in nodes} == {PLUGIN.onnx_domain}
        assert not any(n.op_type in ("Softmax", "GroupQueryAttention", "Attention") for n in graph.node)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
        assert {name: attrs[name].decode() for name in PLUGIN.node_attributes()} == PLUGIN.node_attributes()
        assert attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 2
        assert abs(attrs["scale"] - 32**-0.5) < 1e-7  # qwen3-tiny: head_dim 32
        assert list(nodes[0].input)[3:5] == ["past_key.0", "past_value.0"]


@pytest.mark.parametrize("recipe", every_family(FAMILY_RECIPES))
def test_family_through_the_numpy_reference_matches_hf(recipe, hf_folder, exported, monkeypatch) -> None:
    calls = _implementations(monkeypatch)
    report = run_parity(hf_folder(recipe), exported(recipe, "trt"), new_tokens=32, atol=ATOL_FP32,
                        backend_options=REFERENCE)
    assert report.backend == "emulate"
    _assert_parity(report)
    assert calls["reference"] and not calls["triton"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mistral-tiny", "qwen3-tiny"])  # a 16-token window; head_dim 32
def test_family_through_the_triton_kernel_matches_hf(recipe, hf_folder, exported, monkeypatch) -> None:
    calls = _implementations(monkeypatch)  # no emulation option: the default, the Triton kernel
    report = run_parity(hf_folder(recipe), exported(recipe, "trt"), new_tokens=32, atol=ATOL_FP32,
                        sessions="single", perplexity_tokens=64)  # the interpreter is slow: a short text
    _assert_parity(report)
    assert calls["triton"] and not calls["reference"]


def test_cli_parity_passes_on_a_trt_export(hf_folder, exported, monkeypatch) -> None:
    ran = []
    real = emulate._RUNNERS["reference"]
    monkeypatch.setitem(emulate._RUNNERS, "reference", lambda *args: ran.append(1) or real(*args))
    result = CliRunner().invoke(main, ["parity", str(hf_folder("qwen2-tiny")), str(exported("qwen2-tiny", "trt")),
                                       "--new-tokens", "32", "--emulation", "reference", "--json"])  # fast
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and report["backend"] == "emulate" and report["target"] == "trt"
    assert ran  # --emulation reached the backend


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_emulated_decode_updates_the_bound_cache_in_place(mode, exported, monkeypatch) -> None:
    # Same proof as for the other targets: past and present are bound to one buffer per layer, the
    # addresses never change, and a marker beyond every row's tokens survives the whole generation.
    gen = Generator(exported("llama-tiny", "trt"), emulation=mode)
    prompts = [[1, 50, 60, 70, 80], [1, 33]]
    stream = gen.stream(prompts, max_new_tokens=6, greedy=True, ignore_eos=True, capacity=16)
    addresses = None
    layers = gen.manifest["kv_cache"]["num_layers"]
    for event in stream:
        if event.step == 0:
            addresses = inspection.kv_addresses(gen)
            for layer in range(layers):
                key, value = inspection.read_kv(gen, layer)
                key[:, :, -1], value[:, :, -1] = 7.0, -7.0
                gen.cache.keys[layer].update_inplace(key)
                gen.cache.values[layer].update_inplace(value)
        phase = "prefill" if event.step == 0 else "decode"
        bound = inspection.bound_output_addresses(gen, phase)
        assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
    assert inspection.kv_addresses(gen) == addresses
    for layer in range(layers):
        key, value = inspection.read_kv(gen, layer)
        assert (key[:, :, -1] == 7.0).all() and (value[:, :, -1] == -7.0).all()
        for b in range(len(prompts)):
            assert np.abs(key[b, :, : gen.cache.past_lens[b]]).sum(axis=-1).min() > 0


def test_reference_and_triton_emulation_agree_on_logits(exported, monkeypatch) -> None:
    folder = exported("mistral-tiny", "trt")
    calls = _implementations(monkeypatch)
    generators = {mode: Generator(folder, emulation=mode) for mode in ("reference", "triton")}  # side by side
    logits = {}
    for mode, generator in generators.items():
        result = generator.generate([[1, 5, 9, 11, 200, 7]], max_new_tokens=6, greedy=True,
                                            ignore_eos=True, keep_logits=True)
        logits[mode] = np.stack(result.logits)
    np.testing.assert_allclose(logits["triton"], logits["reference"], atol=1e-4, rtol=0)
    # Each backend kept its own emulation: both implementations ran, equally often.
    assert len(calls["triton"]) == len(calls["reference"]) > 0


def test_unsupported_head_dim_fails_at_export_with_what_is_supported(tmp_path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")  # head_dim 96 / 4 = 24
    with pytest.raises(UnsupportedModelError, match=r"--target trt cannot export llama .*head_dim 16, 32, 64, 128, 256"):
        export_model(tmp_path / "model", tmp_path / "out", target="trt")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "model"), "-o", str(tmp_path / "out"), "--target", "trt"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "use --target ort or --target onnx for this model" in result.stderr
    assert not (tmp_path / "out").exists()
    export_model(tmp_path / "model", tmp_path / "out", target="ort")  # the other targets take it


def test_emulate_without_its_extra_says_which_extra(exported, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(BackendUnavailableError, match=r"needs triton: pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && pip install -e '\.\[emulate\]'"):
        Generator(exported("llama-tiny", "trt"))
    # the numpy reference needs no triton
    assert Generator(exported("llama-tiny", "trt"), **REFERENCE).generate([[1, 5]], max_new_tokens=2).tokens


def test_backends_refuse_targets_they_cannot_run(exported) -> None:
    with pytest.raises(InputError, match="backend 'ort-cpu' does not run trt-target exports .*its attention is "
                                         "kvforge's TensorRT plugin node.*; use one of emulate, tensorrt"):
        Generator(exported("llama-tiny", "trt"), backend="ort-cpu")
    with pytest.raises(InputError, match="backend 'emulate' does not run ort-target exports"):
        Generator(exported("llama-tiny", "ort"), backend="emulate")
    with pytest.raises(InputError, match="emulation='magic' is not an emulation of the plugin; choose one of triton, reference"):
        Generator(exported("llama-tiny", "trt"), emulation="magic")


def test_bf16_trt_export_is_written_and_refused_by_cpu_backends(exported) -> None:
    folder = exported("llama-tiny", "trt", "bf16")
    manifest = json.loads((folder / "kvforge.json").read_text())
    assert manifest["dtype"] == "bf16" and manifest["kv_cache"]["dtype"] == "bfloat16"
    graph = onnx.load(folder / "decode.onnx", load_external_data=False).graph
    assert sum(n.op_type == PLUGIN.name for n in graph.node) == 2
    assert graph.input[3].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    with pytest.raises(InputError, match="bf16 export: ONNX Runtime CPU has no bfloat16 kernels"):
        Generator(folder)
