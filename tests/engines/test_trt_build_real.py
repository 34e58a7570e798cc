"""`kvforge build` with a real TensorRT: TensorRT for RTX, whose ahead-of-time builder runs on the CPU.

Every family's tiny recipe is exported for the `onnx` target and built into real engines (prefill and
decode, fp16 and fp32, and one --single-engine build per dtype): the parsed networks keep one
TensorRT attention layer and two KV-cache-update layers per transformer layer (sliding windows,
softcaps and GQA/MQA survive the import), and engines.json records each engine's build time, size and
whether its attention needed the decomposable fallback. Running the engines needs a GPU
(tests/engines/test_gpu_backends.py). Skipped where tensorrt_rtx is not installed; `.ci/run` installs it.
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("tensorrt_rtx", reason="needs TensorRT for RTX: pip install -e '.[trt-rtx]'")

from shared_exports import every_family  # noqa: E402

from kvforge.cli import main  # noqa: E402
from kvforge.core.engine_plan import ENGINES_MANIFEST, resolve_build_options  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.core.targets import get_target  # noqa: E402
from kvforge.core.tensorrt_flavor import load_tensorrt  # noqa: E402
from kvforge.engines.trt_build import _network, build_engines  # noqa: E402
from kvforge.models.recipes import FAMILY_RECIPES  # noqa: E402

MAX_SEQ_LEN = 64


def _layer_counts(folder, graph: str) -> tuple[dict[str, int], int]:
    trt = load_tensorrt("tensorrt-rtx")
    manifest = load_manifest(folder)
    target = get_target(manifest["target"])
    options = resolve_build_options(manifest, target, max_batch=2, max_seq_len=MAX_SEQ_LEN)
    from kvforge.engines.trt_build import _Log

    log = _Log(trt)
    network, _parser, softcapped = _network(trt, trt.module.Builder(log.logger), log, folder, manifest, target, options,
                                         graph)
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        name = str(network.get_layer(i).type).split(".")[-1]
        counts[name] = counts.get(name, 0) + 1
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.name.startswith("past_key."):
            assert tensor.shape[2] == MAX_SEQ_LEN  # the capacity was made static for the KV-cache-update layer
    return counts, softcapped


def _check_record(record: dict, folder, single: bool, dtype: str, report) -> None:
    report(folder.name + (" --single-engine" if single else ""), record)
    files = {"prefill.engine"} if single else {"prefill.engine", "decode.engine"}
    assert set(record["files"]) == set(record["builds"]) == files
    assert record["tensorrt"]["flavor"] == "tensorrt-rtx" and record["static_capacity"] is True
    assert record["capacity_buckets"] == [MAX_SEQ_LEN] and record["options"]["dtype"] == dtype
    for name, built in record["builds"].items():
        assert built["bytes"] == (folder / "engines" / name).stat().st_size > 0 and built["seconds"] > 0
        assert built["attention"] in ("fused", "decomposed", "decomposed (softcap)")
    for phase in record["engines"]:
        assert record["profiles"][phase]["past_key.0"][0][2] == MAX_SEQ_LEN  # min capacity = max: static
    on_disk = json.loads((folder / "engines" / ENGINES_MANIFEST).read_text())
    assert on_disk == record


@pytest.mark.parametrize("recipe", every_family(FAMILY_RECIPES))
def test_every_family_builds_real_engines_in_fp16(recipe, exported, engine_report) -> None:
    folder = exported(recipe, "onnx", "fp16")
    layers = load_manifest(folder)["kv_cache"]["num_layers"]
    for graph in ("prefill", "decode"):
        counts, softcapped = _layer_counts(folder, graph)
        # One TensorRT attention per transformer layer (softcapped ones are plain ops: TensorRT's attention
        # has no softcap), and the in-place cache update for K and V.
        attention = counts.get("ATTENTION_INPUT", 0)
        assert attention == counts.get("ATTENTION_OUTPUT", 0) and attention + softcapped == layers, counts
        assert softcapped == (layers if recipe == "gemma2-tiny" else 0)
        assert counts.get("KV_CACHE_UPDATE") == 2 * layers, counts
    record = build_engines(folder, max_batch=2, max_seq_len=MAX_SEQ_LEN, force=True)
    _check_record(record, folder, single=False, dtype="fp16", report=engine_report)


@pytest.mark.parametrize("recipe", every_family(FAMILY_RECIPES))
def test_every_family_builds_in_fp32_decomposing_where_needed(recipe, exported, engine_report) -> None:
    folder = exported(recipe, "onnx", "fp32")
    record = build_engines(folder, max_batch=2, max_seq_len=MAX_SEQ_LEN, force=True)
    _check_record(record, folder, single=False, dtype="fp32", report=engine_report)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_single_engine_builds_with_two_profiles(dtype, exported, tmp_path, engine_report) -> None:
    folder = shutil.copytree(exported("llama-tiny", "onnx", dtype), tmp_path / f"llama-tiny-onnx-{dtype}")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    record = build_engines(folder, max_batch=2, max_seq_len=MAX_SEQ_LEN, single_engine=True)
    _check_record(record, folder, single=True, dtype=dtype, report=engine_report)
    assert record["engines"]["decode"] == {"file": "prefill.engine", "graph": "prefill", "profile": 1}
    assert record["profiles"]["decode"]["input_ids"][2] == [2, 1]
    # engines.json says what the file holds (TensorRT-RTX keeps most weights once per profile)
    assert record["engine_bytes"] == (folder / "engines" / "prefill.engine").stat().st_size
    # Same inputs: reused, not rebuilt.
    assert build_engines(folder, max_batch=2, max_seq_len=MAX_SEQ_LEN, single_engine=True) == record


def test_fp32_prefill_attention_has_no_dedicated_kernel_and_falls_back(exported) -> None:
    # What TensorRT-RTX 1.7 does with these shapes: fp16 attention gets its dedicated kernels, fp32 prefill
    # (head_dim 16) does not and is built decomposed; decode (one query row) is fused in both.
    # (Reuses the engines the family tests built, when they ran first: the same inputs give the same record.)
    record = build_engines(exported("llama-tiny", "onnx", "fp32"), max_batch=2, max_seq_len=MAX_SEQ_LEN)
    assert record["builds"]["prefill.engine"]["attention"] == "decomposed"
    fp16 = build_engines(exported("llama-tiny", "onnx", "fp16"), max_batch=2, max_seq_len=MAX_SEQ_LEN)
    assert {b["attention"] for b in fp16["builds"].values()} == {"fused"}


def test_cli_build_json_reports_each_engine(exported, tmp_path) -> None:
    folder = shutil.copytree(exported("llama-tiny", "onnx", "fp16"), tmp_path / "export")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    result = CliRunner().invoke(main, ["build", str(folder), "--max-seq-len", "32", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert set(record["builds"]) == {"prefill.engine", "decode.engine"}
    assert record["kv_cache_bytes_at_max"] == 2 * 2 * 2 * 16 * 2 * 32  # K+V x layers x heads x dim x fp16 x C
    text = CliRunner().invoke(main, ["build", str(folder), "--max-seq-len", "32", "--force"])
    assert text.exit_code == 0 and "decode.engine:" in text.stdout and "KV capacity fixed at 32" in text.stdout


def test_trt_target_is_refused_in_one_line_with_nothing_written(exported, tmp_path) -> None:
    folder = shutil.copytree(exported("llama-tiny", "trt"), tmp_path / "export")
    before = sorted(p.name for p in folder.iterdir())
    result = CliRunner().invoke(main, ["build", str(folder), "--tensorrt", "tensorrt-rtx"])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert len(lines) == 1
    assert "an export of --target trt cannot be built with TensorRT-RTX" in lines[0] and "--target onnx" in lines[0]
    assert sorted(p.name for p in folder.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_failed_rebuild_keeps_the_previous_engines(exported, tmp_path) -> None:
    folder = shutil.copytree(exported("llama-tiny", "onnx", "fp16"), tmp_path / "export")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    assert CliRunner().invoke(main, ["build", str(folder), "--max-seq-len", "32"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in (folder / "engines").iterdir()}
    graph = folder / "decode.onnx"
    graph.write_bytes(graph.read_bytes()[:-100])  # a truncated graph: its sha256 no longer matches
    result = CliRunner().invoke(main, ["build", str(folder), "--max-seq-len", "48"])
    assert result.exit_code == 2 and "decode.onnx" in result.stderr and "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in (folder / "engines").iterdir()} == before
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no staging left behind
