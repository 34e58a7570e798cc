"""kvforge.exporter.checkpoint: the lazy, validated view of a folder's safetensors weights (reads equal what
was saved; every broken folder is refused from its headers with a message naming the file), the free-space
check before writing, and the streaming memory bound."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kvforge.core.errors import ExportError, InputError  # noqa: E402
from kvforge.core.output_folder import require_free_space  # noqa: E402
from kvforge.exporter.checkpoint import open_checkpoint  # noqa: E402


def _tensors(dtype=torch.float16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=generator).to(dtype),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator).to(dtype),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=generator).to(dtype),
        "model.layers.0.input_layernorm.weight": torch.ones(8, dtype=torch.float32),  # fp32 norm beside fp16
        "model.rotary.positions": torch.arange(6, dtype=torch.int64),  # integers take no part in the dtype check
    }


def _save_sharded(folder: Path, tensors: dict[str, torch.Tensor], split: int = 2) -> dict[str, str]:
    """Two shards and their index, as save_pretrained writes them; returns the weight_map."""
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:split], "model-00002-of-00002.safetensors": names[split:]}
    weight_map = {}
    for file, shard_names in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in shard_names}, folder / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in shard_names})
    _write_index(folder, weight_map)
    return weight_map


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _refused(folder: Path) -> str:
    with pytest.raises(InputError) as caught:
        open_checkpoint(folder)
    return str(caught.value)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "two-shards-with-index"])
def test_reads_equal_what_was_saved(tmp_path: Path, sharded: bool) -> None:
    tensors = _tensors()
    if sharded:
        weight_map = _save_sharded(tmp_path, tensors)
    else:
        safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
        weight_map = dict.fromkeys(tensors, "model.safetensors")
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.names == sorted(tensors)
    assert checkpoint.dtype == "float16"
    assert checkpoint.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert checkpoint.largest_nbytes == 32 * 8 * 2
    for name, tensor in tensors.items():
        info = checkpoint.info(name)
        assert (info.shape, info.file, info.nbytes) == (tuple(tensor.shape), tmp_path / weight_map[name],
                                                       tensor.numel() * tensor.element_size())
        assert name in checkpoint
        read = checkpoint.read(name)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
    assert checkpoint.info("model.layers.0.input_layernorm.weight").dtype == "F32"
    assert checkpoint.info("model.embed_tokens.weight").dtype == "F16"
    assert "lm_head.weight" not in checkpoint
    with pytest.raises(KeyError, match="lm_head.weight"):
        checkpoint.read("lm_head.weight")


def test_the_index_decides_which_files_are_shards(tmp_path: Path) -> None:
    tensors = _tensors()
    _save_sharded(tmp_path, tensors)
    # A leftover single-file save beside the index is not a shard (and would otherwise duplicate tensors).
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).names == sorted(tensors)


def test_an_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    _save_sharded(tmp_path, _tensors())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    message = _refused(tmp_path)
    assert f"names the shard {tmp_path / 'model-00002-of-00002.safetensors'}, which does not exist" in message
    assert "fetch the missing shard" in message


def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    safetensors_torch.save_file(_tensors(), tmp_path / "elsewhere.safetensors")
    _write_index(folder, dict.fromkeys(_tensors(), "../elsewhere.safetensors"))
    assert "names the shard '../elsewhere.safetensors' outside the model folder" in _refused(folder)


def test_a_truncated_shard_is_refused_before_reading(tmp_path: Path) -> None:
    _save_sharded(tmp_path, _tensors())
    shard = tmp_path / "model-00001-of-00002.safetensors"
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size - 1)  # the last tensor's last byte is missing
    message = _refused(tmp_path)
    assert f"{shard} is truncated: it has {size - 1} bytes but its header needs {size}" in message
    assert "fetch the file again" in message
    with shard.open("r+b") as handle:
        handle.truncate(20)  # not even the whole header
    assert f"{shard} is truncated: it has 20 bytes" in _refused(tmp_path)
    with shard.open("r+b") as handle:
        handle.truncate(3)  # not even the header's length
    assert f"{shard} is truncated: it has 3 bytes but its header needs 8" in _refused(tmp_path)


@pytest.mark.parametrize("header, says", [
    (b"not json", "its header is not JSON"),
    (b"[1, 2]", "its header is a JSON list, not an object"),
    (json.dumps({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}).encode(), "w has the unknown dtype 'Q7'"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2, -1], "data_offsets": [0, 2]}}).encode(),
     "w has the shape [2, -1], not a list of non-negative integers"),
    (json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}).encode(),
     "w has the data_offsets [4, 0]"),
    (json.dumps({"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 8]}}).encode(),
     "w is F16 [4, 4] (32 bytes) but its data_offsets span 8 bytes"),
], ids=["not-json", "not-an-object", "unknown-dtype", "negative-dim", "reversed-offsets", "size-mismatch"])
def test_a_shard_with_an_invalid_header_is_refused(tmp_path: Path, header: bytes, says: str) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    message = _refused(tmp_path)
    assert f"{file} is not a valid safetensors file: {says}" in message, message


def test_an_absurd_header_length_is_an_invalid_file(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 1 << 62) + bytes(64))
    assert f"{file} is not a valid safetensors file: its header length reads {1 << 62} bytes" in _refused(tmp_path)


def test_a_tensor_the_index_puts_in_the_wrong_shard_is_refused(tmp_path: Path) -> None:
    weight_map = _save_sharded(tmp_path, _tensors())
    weight_map["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"  # it is in shard 1
    weight_map["lm_head.weight"] = "model-00001-of-00002.safetensors"  # in no shard at all
    _write_index(tmp_path, weight_map)
    message = _refused(tmp_path)
    assert (f"maps lm_head.weight to {tmp_path / 'model-00001-of-00002.safetensors'}, which does not hold it "
            "(it is in no shard)") in message, message
    del weight_map["lm_head.weight"]
    _write_index(tmp_path, weight_map)
    message = _refused(tmp_path)
    assert (f"maps model.embed_tokens.weight to {tmp_path / 'model-00002-of-00002.safetensors'}, which does not "
            f"hold it (it is in {tmp_path / 'model-00001-of-00002.safetensors'})") in message, message


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_torch.save_file(tensors, tmp_path / "a.safetensors")
    safetensors_torch.save_file({"model.layers.0.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]},
                                tmp_path / "b.safetensors")
    message = _refused(tmp_path)
    assert (f"model.layers.0.mlp.up_proj.weight is stored twice, in {tmp_path / 'a.safetensors'} and in "
            f"{tmp_path / 'b.safetensors'}") in message


def test_weight_matrices_of_mixed_dtypes_across_shards_are_refused(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
    _save_sharded(tmp_path, tensors)  # shard 1: embed + q_proj (F16); shard 2: up_proj (BF16), norm, ints
    message = _refused(tmp_path)
    assert "mix dtypes: model.embed_tokens.weight is F16 (in model-00001-of-00002.safetensors), " \
           "model.layers.0.mlp.up_proj.weight is BF16 (in model-00002-of-00002.safetensors)" in message, message
    assert "re-save the checkpoint in one dtype" in message


def test_1d_tensors_and_quantisation_scales_keep_their_own_dtypes(tmp_path: Path) -> None:
    tensors = {
        "w.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "w.weight_scale_inv": torch.ones(1, 1, dtype=torch.float32),  # a block scale: not a weight matrix
        "norm.weight": torch.ones(4, dtype=torch.float32),
        "q.qweight": torch.zeros(4, 2, dtype=torch.int32),
    }
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).dtype == "bfloat16"


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert f"{tmp_path} has no weights (*.safetensors nor model.safetensors.index.json)" in _refused(tmp_path)
    assert "is not a folder" in _refused(tmp_path / "nowhere")


def test_require_free_space_refuses_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "not" / "made" / "yet"
    with pytest.raises(ExportError) as caught:
        require_free_space(out, 10**18, "the export")
    message = str(caught.value)
    assert message.startswith(f"the export needs about 1000000000.0 GB and {tmp_path} has ")
    assert "GB free; free space on that filesystem or choose another output folder" in message \
        or "MB free; free space on that filesystem or choose another output folder" in message, message
    assert not (tmp_path / "not").exists()
    require_free_space(out, 1, "the export")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ExportError, match="needs about"):
        require_free_space(tmp_path, int(free / 1.04), "the export")  # fits, but not with the 5% margin


_STREAM = textwrap.dedent("""
    import json, sys
    import psutil
    import safetensors.torch  # noqa: F401  (imported before the baseline: read() would import it)
    import torch  # noqa: F401
    from kvforge.exporter.checkpoint import open_checkpoint

    process = psutil.Process()
    checkpoint = open_checkpoint(sys.argv[1])
    baseline = process.memory_info().rss
    peak = 0
    for name in checkpoint.names:
        tensor = checkpoint.read(name)
        float(tensor.sum())  # touches every page of it
        peak = max(peak, process.memory_info().rss - baseline)
        del tensor
    print(json.dumps({"growth": peak, "largest": checkpoint.largest_nbytes, "total": checkpoint.nbytes}))
""")


def test_streaming_every_tensor_holds_about_one_tensor(tmp_path: Path) -> None:
    """RSS grows by the tensor held, not by the file: the small tensors together (48 MB) plus the big one
    (64 MB) exceed 1.5x the big one, so a reader that kept the file's pages mapped would fail here."""
    pytest.importorskip("psutil")
    generator = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(4096, 4096, generator=generator)}  # 64 MB of float32
    tensors.update({f"small.{i}": torch.randn(1024, 2048, generator=generator) for i in range(6)})  # 8 MB each
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    del tensors
    run = subprocess.run([sys.executable, "-c", _STREAM, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["largest"] == 64 << 20 and figures["total"] == 112 << 20
    # The lower bound shows the measurement sees a held tensor at all.
    assert 0.5 * figures["largest"] < figures["growth"] <= 1.5 * figures["largest"], figures


def _make_real_shape():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "make_real_shape.py"
    spec = importlib.util.spec_from_file_location("make_real_shape", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1536, tie_word_embeddings=False, max_position_embeddings=256,
                   rope_theta=500000.0, bos_token_id=1500, eos_token_id=1501)


def test_make_real_shape_writes_a_folder_transformers_loads(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make = _make_real_shape()
    out = tmp_path / "tiny"
    # 200 KB shards: the tiny model is sharded, so the index is written and checked too.
    assert make.main(["llama-3.1-8b", str(out), "--shape-json", json.dumps(_TINY_SHAPE), "--shard-gb", "0.0002",
                      "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    # embed_tokens, 9 per layer, the final norm, lm_head
    assert "a custom shape: 21 tensors" in printed and "[21/21 tensors]" in printed and "peak RSS" in printed, printed
    checkpoint = open_checkpoint(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(checkpoint.files) > 1 and index["metadata"]["total_size"] == checkpoint.nbytes
    assert checkpoint.dtype == "float16" and "lm_head.weight" in checkpoint  # untied here; fp16 by default
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, checkpoint.read("model.layers.1.mlp.down_proj.weight"))
    assert torch.equal(checkpoint.read("model.norm.weight"), torch.ones(64, dtype=torch.bfloat16))
    assert abs(float(checkpoint.read("model.embed_tokens.weight").float().std()) - 0.02) < 0.002
    with torch.no_grad():
        logits = model(torch.tensor([[1500, 10, 20, 30]])).logits
    assert logits.shape == (1, 4, 1536) and bool(torch.isfinite(logits).all())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1500, 1501)
    assert tokenizer("Hello world").input_ids[0] == 1500
    # Only a folder the script wrote is replaced, and only when asked to.
    assert make.main(["llama-3.1-8b", str(out), "--shape-json", json.dumps(_TINY_SHAPE)]) == 2
    assert f"{out} already exists; pass --force to replace it" in capsys.readouterr().err
    assert make.main(["llama-3.1-8b", str(tmp_path), "--shape-json", json.dumps(_TINY_SHAPE)]) == 2
    assert "is not a real-shape checkpoint (no kvforge_real_shape.json)" in capsys.readouterr().err


def test_make_real_shape_names_match_transformers_and_the_real_parameter_counts() -> None:
    pytest.importorskip("transformers")
    make = _make_real_shape()
    counts = {}
    for name in make.SHAPES:
        config = make.build_config(make.SHAPES[name], "bf16")
        plan = make.tensor_plan(config, "bf16")
        counts[name] = sum(t.numel for t in plan)
        assert ("lm_head.weight" in [t.name for t in plan]) is (not config.tie_word_embeddings), name
    # The published sizes: SmolLM2-135M, Llama-3.2-1B (1.24B), Llama-3.1-8B (8.03B).
    assert counts == {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}
    config = make.build_config(make.SHAPES["llama-3.2-1b"], "bf16")
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0
    assert config.head_dim == 64 and config.max_position_embeddings == 131072
