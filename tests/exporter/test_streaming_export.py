"""Exports that stream their weights (exporter/lazy_weights.py): the same graphs as from the whole model,
a tied embedding stored once, int4 rounded tensor by tensor exactly as ONNX Runtime's whole-model
quantiser does, int4 with fp16 activations, and memory that does not follow the model's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from kvforge.cli import main  # noqa: E402


def _initializers(folder: Path, graph: str = "decode.onnx") -> dict:
    import onnx_ir as ir

    model = ir.load(folder / graph)
    return {name: value.const_value.numpy() for name, value in model.graph.initializers.items()}


def test_a_streamed_export_answers_as_the_whole_model_export(hf_folder, tmp_path):
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    source = hf_folder("llama3-tiny")
    said: list[str] = []
    export_model(source, tmp_path / "streamed", progress=said.append)
    export_model(source, tmp_path / "whole", stream=False)
    assert any(line.startswith("streaming ") for line in said), said
    prompts = [[1, 50, 60, 70, 80], [1, 33, 44]]
    streamed = Generator(tmp_path / "streamed").generate(prompts, max_new_tokens=16, greedy=True, ignore_eos=True)
    whole = Generator(tmp_path / "whole").generate(prompts, max_new_tokens=16, greedy=True, ignore_eos=True)
    assert streamed.tokens == whole.tokens
    ours, theirs = _initializers(tmp_path / "streamed"), _initializers(tmp_path / "whole")
    assert sorted(ours) == sorted(theirs)
    assert all(np.array_equal(ours[name], theirs[name]) for name in ours)


def test_a_tied_embedding_is_stored_once(exported):
    import json as json_module

    folder = exported("llama3-tiny")  # tied: vocab 512, hidden 64
    tables = [name for name, array in _initializers(folder).items() if sorted(array.shape) == [64, 512]]
    assert len(tables) == 1, tables
    manifest = json_module.loads((folder / "kvforge.json").read_text())
    # The [H, V] table is read by both the lookup and the lm_head.
    assert manifest["files"]["model.weights"]["bytes"] < 2 * 512 * 64 * 4 + 200_000


@pytest.mark.parametrize("recipe,head_bits,chunk", [("llama-tiny", None, 1000), ("llama3-tiny", 8, None),
                                                    ("qwen3-tiny", None, None)])
def test_int4_rounded_per_tensor_equals_onnx_runtimes_whole_model_quantiser(hf_folder, tmp_path, monkeypatch,
                                                                            recipe, head_bits, chunk):
    from kvforge.exporter.export import export_model
    from kvforge.exporter.quantization import matmuls as quantize
    from kvforge.exporter.quantization import rtn as quantize_tensors

    if chunk is not None:  # weights quantised in slices of columns (rows of the embedding), as large ones are
        monkeypatch.setattr(quantize_tensors, "CHUNK_ELEMENTS", chunk)
    source = hf_folder(recipe)
    export_model(source, tmp_path / "lazy", quantize="int4", quant_method="rtn", lm_head_bits=head_bits)
    whole_model = quantize.quantize_model
    monkeypatch.setattr(quantize, "quantize_model", lambda *a, **k: whole_model(*a, **k, whole_model=True))
    export_model(source, tmp_path / "ort", quantize="int4", quant_method="rtn", lm_head_bits=head_bits, stream=False)
    ours, theirs = _initializers(tmp_path / "lazy"), _initializers(tmp_path / "ort")
    assert sorted(ours) == sorted(theirs)
    different = [name for name in ours if not np.array_equal(ours[name], theirs[name])]
    assert not different
    assert any(name.endswith("_Q4") for name in ours)


def test_int4_with_fp16_activations_for_onnx_runtime_cuda(hf_folder, tmp_path):
    import onnx_ir as ir

    from kvforge.exporter.export import export_model
    from kvforge.tools.quant_accuracy import measure_quantized

    export_model(hf_folder("llama-tiny"), tmp_path / "q", quantize="int4", quant_method="rtn", dtype="fp16")
    graph = ir.load(tmp_path / "q" / "decode.onnx").graph
    nbits = [node for node in graph if node.op_type == "MatMulNBits"]
    assert nbits and all(node.inputs[2].dtype == ir.DataType.FLOAT16 for node in nbits)
    assert all(node.inputs[0].dtype == ir.DataType.FLOAT16 for node in nbits)
    # ONNX Runtime's CPU runs fp16 MatMulNBits too: the int4 gate of `kvforge parity` (perplexity within 30%).
    accuracy = measure_quantized(tmp_path / "q")
    assert accuracy["perplexity_relative_increase"] < 0.3, accuracy


def test_hqq_still_refuses_fp16(hf_folder, tmp_path):
    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model

    with pytest.raises(InputError, match="--quant-method hqq runs with fp32 activations only"):
        export_model(hf_folder("llama-tiny"), tmp_path / "q", quantize="int4", dtype="fp16", quant_method="hqq")


def test_accuracy_check_options(hf_folder, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "a"),
                                  "--accuracy-check"])
    assert result.exit_code == 2 and "--accuracy-check goes with --quantize or --kv-cache" in result.output
    result = runner.invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "b"),
                                  "--quantize", "int8", "--no-accuracy-check", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)["manifest"]
    assert manifest["quantization"]["accuracy"] == {"skipped": "--no-accuracy-check"}


def test_a_disk_too_small_is_said_before_anything_is_written(hf_folder, tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda _path: SimpleNamespace(total=10**9, used=0, free=20_000))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(out)])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "the export needs about" in message and "free; free space on that filesystem" in message, message
    assert list(tmp_path.iterdir()) == []


# The child's own peak: VmHWM (ru_maxrss would keep the forking pytest process's peak across exec).
_PEAK = """
import sys
from kvforge.exporter.export import export_model
export_model(sys.argv[1], sys.argv[2], dtype="fp32")
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


@pytest.mark.slow
def test_a_streamed_exports_memory_does_not_grow_with_the_weights(tmp_path):
    """The same 4-layer Llama graph at hidden sizes 256 and 1024 (~30 MB and ~320 MB of fp32 weights): the
    streamed export's peak RSS grows by a small part of what the weights grow by (its largest tensor and the
    writer's buffers; ~50-90 MB measured), where an export that holds the model grows by all of it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    peaks, weights = {}, {}
    for hidden in (256, 1024):
        config = LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        source = tmp_path / f"hf{hidden}"
        LlamaForCausalLM(config).save_pretrained(source)
        weights[hidden] = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        done = subprocess.run([sys.executable, "-c", _PEAK, str(source), str(tmp_path / f"out{hidden}")],
                              capture_output=True, text=True, check=True)
        peaks[hidden] = int(done.stdout.strip().splitlines()[-1])
    added = weights[1024] - weights[256]
    assert added > 250e6
    # A few copies of the largest tensor (the 33 MB embedding: read, cast, written) at most; holding the
    # weights would add all of `added`.
    assert peaks[1024] - peaks[256] < 0.4 * added, (peaks, weights)


@pytest.mark.parametrize("damage", ["truncate", "drop-shard", "mixed-dtypes"])
def test_a_damaged_checkpoint_is_one_line_exit_2_and_nothing_written(hf_folder, tmp_path, damage):
    """The export's CLI on a damaged folder: the shards are checked before anything is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tmp_path / "model"
    shutil.copytree(hf_folder("llama-tiny"), source)
    weights = source / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1000])
        says = "truncated"
    else:
        tensors = load_file(weights)
        names = sorted(tensors)
        half = {name: tensors[name] for name in names[: len(names) // 2]}
        rest = {name: tensors[name] for name in names[len(names) // 2:]}
        if damage == "mixed-dtypes":
            rest = {name: t.half() for name, t in rest.items()}
        weights.unlink()
        save_file(half, source / "model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {**dict.fromkeys(half, "model-00001-of-00002.safetensors"),
                                                **dict.fromkeys(rest, "model-00002-of-00002.safetensors")}}
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
        if damage == "mixed-dtypes":
            save_file(rest, source / "model-00002-of-00002.safetensors")
            says = "dtype"
        else:
            says = "model-00002-of-00002.safetensors"
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(source), "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("kvforge: error:")]
    assert len(lines) == 1 and says in lines[0], result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _deeper(hf_folder, tmp_path: Path, recipe: str, layers: int) -> Path:
    """A copy of the recipe's folder with `layers` decoder layers (seeded random weights): the tiny recipes
    have two, too few for layer stamping."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / f"{recipe}-{layers}"
    shutil.copytree(hf_folder(recipe), folder)
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("recipe,options", [("llama3-tiny", {}), ("qwen3-tiny", {"quantize": "int4", "quant_method": "rtn"})])
def test_stamped_layers_give_the_graph_a_trace_of_every_layer_gives(hf_folder, tmp_path, recipe, options):
    from collections import Counter

    import onnx_ir as ir

    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    source = _deeper(hf_folder, tmp_path, recipe, 5)
    said: list[str] = []
    export_model(source, tmp_path / "stamped", progress=said.append, **options)
    export_model(source, tmp_path / "traced", stamp=False, **options)
    assert any(line.startswith("tracing 2 of the 5 alike layers") for line in said), said
    for graph in ("prefill.onnx", "decode.onnx"):
        ours, theirs = ir.load(tmp_path / "stamped" / graph).graph, ir.load(tmp_path / "traced" / graph).graph
        assert Counter(n.op_type for n in ours) == Counter(n.op_type for n in theirs)
        assert [v.name for v in ours.inputs] == [v.name for v in theirs.inputs]
        assert [v.name for v in ours.outputs] == [v.name for v in theirs.outputs]
    # Every weight the same (by name where torch.onnx named it; its numbered constants by value).
    ours, theirs = _initializers(tmp_path / "stamped"), _initializers(tmp_path / "traced")
    named = {name for name in ours if not name.startswith("val_")}
    assert named == {name for name in theirs if not name.startswith("val_")} and any(".layers.4." in n for n in named)
    assert all(np.array_equal(ours[name], theirs[name]) for name in named)
    assert sorted(a.tobytes() for a in ours.values()) == sorted(a.tobytes() for a in theirs.values())
    prompts = [[1, 50, 60, 70, 80], [1, 33, 44]]
    stamped = Generator(tmp_path / "stamped").generate(prompts, max_new_tokens=12, greedy=True, ignore_eos=True)
    traced = Generator(tmp_path / "traced").generate(prompts, max_new_tokens=12, greedy=True, ignore_eos=True)
    assert stamped.tokens == traced.tokens


def test_layers_that_differ_are_traced_every_one(hf_folder, tmp_path):
    from kvforge.exporter.export import export_model

    said: list[str] = []
    export_model(_deeper(hf_folder, tmp_path, "gemma2-tiny", 4), tmp_path / "g", progress=said.append)
    assert any("every layer: gemma2 is not among the families whose layers are alike" in line for line in said), said
