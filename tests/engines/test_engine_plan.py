"""TensorRT engines as plain data (kvforge/core/engine_plan.py) and `kvforge build` without TensorRT.

TensorRT cannot be installed on these machines: what the build and the TensorRT backend decide
(options, profiles, layouts, the engine manifest and its checks, binding plans) is tested here; the
TensorRT calls themselves run only on a GPU machine (tests/test_trt_gpu.py, marker `gpu`).
"""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.engine_plan import (
    ENGINES_MANIFEST,
    RECORD_DIGEST,
    BuildOptions,
    binding_plan,
    build_key,
    check_runtime_matches,
    engine_capacity_buckets,
    engine_layout,
    engines_manifest,
    graph_key,
    load_engines_manifest,
    profile_shapes,
    record_problem,
    resolve_build_options,
    static_capacity,
)
from kvforge.core.errors import InputError, ManifestError
from kvforge.core.targets import get_target

TRT = {"flavor": "tensorrt", "version": "10.15.1"}
# The targets as the build resolves them once it has read a manifest (_manifest()'s default is trt).
TRT_TARGET, ONNX_TARGET = get_target("trt"), get_target("onnx")


def _manifest(target: str = "trt", dtype: str = "fp16", layers: int = 2, max_capacity: int = 8192) -> dict:
    def io(phase: str) -> list[dict]:
        names = ["input_ids", "past_lens"] + (["logits_index"] if phase == "prefill" else [])  # [B, K]
        names += [f"past_{k}.{i}" for i in range(layers) for k in ("key", "value")]
        return [{"name": n} for n in names]

    return {
        "target": target, "dtype": dtype,
        "model": {"vocab_size": 512, "num_heads": 4},
        "kv_cache": {"num_layers": layers, "num_kv_heads": 2, "head_dim": 64, "max_capacity": max_capacity,
                     "dtype": "float16"},
        "graphs": {"prefill": {"inputs": io("prefill")}, "decode": {"inputs": io("decode")}},
        "files": {"prefill.onnx": {"sha256": "a", "bytes": 1}, "decode.onnx": {"sha256": "b", "bytes": 1},
                  "model.weights": {"sha256": "c", "bytes": 100}},
        "weights_sharing": {"weights_bytes": 1000},
    }


def test_build_options_defaults_and_errors() -> None:
    options = resolve_build_options(_manifest(), TRT_TARGET)
    assert options == BuildOptions("fp16", 1, 4096, 4096, False)
    assert resolve_build_options(_manifest(max_capacity=1024), TRT_TARGET).max_seq_len == 1024
    with pytest.raises(InputError, match="an export of --target ort cannot be built into TensorRT engines"):
        resolve_build_options(_manifest(target="ort"), get_target("ort"))
    with pytest.raises(InputError, match="--dtype bf16 but the export is fp16: .* re-export with --dtype bf16"):
        resolve_build_options(_manifest(), TRT_TARGET, dtype="bf16")
    with pytest.raises(InputError, match="--max-seq-len 9000 exceeds the model's 8192 positions"):
        resolve_build_options(_manifest(), TRT_TARGET, max_seq_len=9000)
    with pytest.raises(InputError, match="--max-input-len 600 exceeds --max-seq-len 512"):
        resolve_build_options(_manifest(), TRT_TARGET, max_seq_len=512, max_input_len=600)
    with pytest.raises(InputError, match="--max-batch must be a positive integer, got 0"):
        resolve_build_options(_manifest(), TRT_TARGET, max_batch=0)


def test_profiles_cover_the_runtime_shapes() -> None:
    options = resolve_build_options(_manifest(), TRT_TARGET, max_batch=4, max_input_len=512, max_seq_len=2048)
    prefill = profile_shapes(_manifest(), TRT_TARGET, options, "prefill")
    decode = profile_shapes(_manifest(), TRT_TARGET, options, "decode")
    assert prefill["input_ids"] == ((1, 1), (4, 512), (4, 512))
    assert decode["input_ids"] == ((1, 1), (4, 1), (4, 1))
    assert prefill["past_key.1"] == ((1, 2, 1, 64), (4, 2, 2048, 64), (4, 2, 2048, 64))
    assert "logits_index" in prefill and "logits_index" not in decode
    assert set(prefill) - {"logits_index"} == set(decode)
    single = resolve_build_options(_manifest(), TRT_TARGET, max_batch=4, max_seq_len=2048, single_engine=True)
    # One engine from prefill.onnx: its decode profile sets every prefill input, query length 1.
    assert profile_shapes(_manifest(), TRT_TARGET, single, "decode")["logits_index"] == ((1, 1), (4, 1), (4, 1))
    assert prefill["logits_index"] == ((1, 1), (4, 1), (4, 16))  # up to 16 positions: speculative checks


def test_engine_layout_and_weight_copies(tmp_path) -> None:
    two = resolve_build_options(_manifest(), TRT_TARGET)
    one = resolve_build_options(_manifest(), TRT_TARGET, single_engine=True)
    assert {p: e["file"] for p, e in engine_layout(two).items()} == {"prefill": "prefill.engine", "decode": "decode.engine"}
    assert engine_layout(one)["decode"] == {"file": "prefill.engine", "graph": "prefill", "profile": 1}
    (tmp_path / "kvforge.json").write_text("{}")
    gpu = {"name": "GPU", "compute_capability": "9.0"}
    builds = {"prefill.engine": {"bytes": 1300}, "decode.engine": {"bytes": 1200}}
    rec_two = engines_manifest(tmp_path, _manifest(), TRT_TARGET, two, "k", TRT, gpu, {}, 1.0, "0.1.0", builds)
    rec_one = engines_manifest(tmp_path, _manifest(), TRT_TARGET, one, "k", TRT, gpu, {}, 1.0, "0.1.0",
                               {"prefill.engine": {"bytes": 1900}})
    # what the files hold, not a claim about copies: a TensorRT-RTX engine with two profiles stores most
    # weights per profile (docs/tensorrt-and-gpus.md)
    assert rec_two["engine_bytes"] == 2500 and rec_one["engine_bytes"] == 1900
    assert rec_two["weights_bytes"] == rec_one["weights_bytes"] == 1000 and "weights_on_gpu_bytes" not in rec_one
    assert rec_two["capacity_buckets"][0] == 64 and rec_two["capacity_buckets"][-1] == 4096
    assert rec_two["static_capacity"] is False
    assert rec_two["profiles"]["decode"]["input_ids"] == [[1, 1], [1, 1], [1, 1]]
    # K and V, 2 layers, 2 KV heads, head_dim 64, fp16, at capacity 4096 for one row.
    assert rec_two["kv_cache_bytes_at_max"] == 2 * 2 * 2 * 64 * 2 * 4096


def test_onnx_target_engines_fix_the_capacity() -> None:
    # TensorRT's KV-cache-update layer (from TensorScatter) needs the capacity static: min = opt = max.
    manifest = _manifest(target="onnx")
    options = resolve_build_options(manifest, ONNX_TARGET, max_batch=4, max_seq_len=1024)
    assert static_capacity(ONNX_TARGET) and not static_capacity(TRT_TARGET)
    assert engine_capacity_buckets(ONNX_TARGET, options) == (1024,)
    for phase in ("prefill", "decode"):
        assert profile_shapes(manifest, ONNX_TARGET, options, phase)["past_value.0"] == (
            (1, 2, 1024, 64), (4, 2, 1024, 64), (4, 2, 1024, 64))


def test_build_key_changes_with_every_input() -> None:
    manifest, options = _manifest(), resolve_build_options(_manifest(), TRT_TARGET)
    plugin = {"kernel_source": "abc", "triton": "3.6.0"}
    base = build_key(manifest, options, TRT, "9.0", "0.1.0", plugin)
    assert base == build_key(copy.deepcopy(manifest), options, dict(TRT), "9.0", "0.1.0", dict(plugin))
    changed = copy.deepcopy(manifest)
    changed["files"]["model.weights"]["sha256"] = "d"
    assert build_key(changed, options, TRT, "9.0", "0.1.0", plugin) != base
    assert build_key(manifest, resolve_build_options(manifest, TRT_TARGET, max_batch=2), TRT, "9.0", "0.1.0", plugin) != base
    assert build_key(manifest, options, {**TRT, "version": "10.16.0"}, "9.0", "0.1.0", plugin) != base
    assert build_key(manifest, options, {"flavor": "tensorrt-rtx", "version": "10.15.1"}, "9.0", "0.1.0", plugin) != base
    assert build_key(manifest, options, TRT, "8.9", "0.1.0", plugin) != base
    assert build_key(manifest, options, TRT, "9.0", "0.2.0", plugin) != base
    assert build_key(manifest, options, TRT, "9.0", "0.1.0", {**plugin, "kernel_source": "abd"}) != base
    assert build_key(manifest, options, TRT, "9.0", "0.1.0", {**plugin, "triton": "3.7.0"}) != base


def test_engines_json_records_a_sha256_of_itself(tmp_path) -> None:
    (tmp_path / "kvforge.json").write_text("{}")
    gpu = {"name": "GPU", "compute_capability": "9.0"}
    record = engines_manifest(tmp_path, _manifest(), TRT_TARGET, resolve_build_options(_manifest(), TRT_TARGET), "k", TRT, gpu, {}, 1.25, "0.1")
    path = tmp_path / ENGINES_MANIFEST
    # Read back from the file as written (indented, keys in their order): still matches.
    assert record_problem(json.loads(json.dumps(record, indent=2)), path) is None
    edited = copy.deepcopy(record)
    edited["options"]["max_batch"] = 64
    assert "was modified after `kvforge build` wrote it" in record_problem(edited, path)
    # An engines.json of an older kvforge has none: let through (its engine files are still checked).
    assert record_problem({k: v for k, v in record.items() if k != RECORD_DIGEST}, path) is None


def _engine_folder(tmp_path, export, **change) -> object:
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "prefill.engine").write_bytes(b"x" * 10)
    from kvforge.core.manifest import sha256_file

    record = {"format": "kvforge-engines/2", "export": {"manifest_sha256": sha256_file(export / "kvforge.json")},
              "files": {"prefill.engine": {"sha256": "s", "bytes": 10}}, "tensorrt": TRT,
              "gpu": {"compute_capability": "9.0"}}
    record.update(change)
    (engines / ENGINES_MANIFEST).write_text(json.dumps(record))
    return engines


def test_engine_manifest_checks(tmp_path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "kvforge.json").write_text('{"format": "kvforge/1"}')
    with pytest.raises(ManifestError, match="no TensorRT engines were built there; run `kvforge build"):
        load_engines_manifest(tmp_path / "none", export)
    engines = _engine_folder(tmp_path, export)
    record = load_engines_manifest(engines, export)
    check_runtime_matches(record, TRT, "9.0")
    with pytest.raises(ManifestError, match="built with tensorrt 10.15.1, this is tensorrt 10.16.0"):
        check_runtime_matches(record, {**TRT, "version": "10.16.0"}, "9.0")
    with pytest.raises(ManifestError, match="built with tensorrt 10.15.1, this is tensorrt-rtx 1.7.1"):
        check_runtime_matches(record, {"flavor": "tensorrt-rtx", "version": "1.7.1"}, "9.0")
    with pytest.raises(ManifestError, match="built for compute capability 9.0, this GPU is 8.9"):
        check_runtime_matches(record, TRT, "8.9")
    # TensorRT-RTX engines are portable and specialised for the GPU when loaded: no architecture check.
    rtx = {"flavor": "tensorrt-rtx", "version": "1.7.1.116"}
    check_runtime_matches({**record, "tensorrt": rtx, "gpu": {"compute_capability": "8.0, 8.6, 8.9, 12.0+"}}, rtx, "8.9")
    (engines / "prefill.engine").write_bytes(b"x")
    with pytest.raises(ManifestError, match=r"has 1 bytes, not the 10 engines.json records \(truncated or modified\)"):
        load_engines_manifest(engines, export)
    (export / "kvforge.json").write_text('{"format": "kvforge/1", "changed": true}')
    with pytest.raises(ManifestError, match="built from another export"):
        load_engines_manifest(engines, export)


def test_engine_manifest_paths_stay_inside(tmp_path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "kvforge.json").write_text("{}")
    engines = _engine_folder(tmp_path, export, files={"../outside.engine": {"sha256": "s", "bytes": 1}})
    with pytest.raises(ManifestError, match="'../outside.engine', which is not a file name inside the engine folder"):
        load_engines_manifest(engines, export)


@pytest.mark.parametrize(("change", "message"), [
    ({"export": "x"}, "'export' must be an object, got 'x'"),
    ({"files": ["prefill.engine"]}, "'files' must be an object"),
    ({"files": {"prefill.engine": {"sha256": "s", "bytes": "10"}}}, r"files\['prefill.engine'\] must be an object with"),
    ({"options": {"max_batch": "8"}}, "options.max_batch must be a positive integer, got '8'"),
    ({"capacity_buckets": "64"}, "'capacity_buckets' must be a non-empty list of positive integers"),
    ({"engines": {"prefill": "prefill.engine"}}, r"engines\['prefill'\] must be an object with 'file' and 'profile'"),
    ({"engines": {"prefill": {"file": "other.engine", "profile": 0}}}, "'other.engine' is not listed in 'files'"),
    ({"tensorrt": "10.15"}, "'tensorrt' must be an object"),
])
def test_engine_manifest_types_are_checked(tmp_path, change, message) -> None:
    """A crafted engines.json fails in one ManifestError naming the field, not an AttributeError."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "kvforge.json").write_text("{}")
    engines = _engine_folder(tmp_path, export)
    record = json.loads((engines / ENGINES_MANIFEST).read_text())
    (engines / ENGINES_MANIFEST).write_text(json.dumps({**record, **change}))
    with pytest.raises(ManifestError, match=message):
        load_engines_manifest(engines, export)


@pytest.mark.parametrize("single", [False, True])
def test_binding_plan_binds_past_and_present_to_one_buffer(single: bool) -> None:
    manifest = _manifest(layers=3)
    for phase, seq in (("prefill", 37), ("decode", 1)):
        plan = binding_plan(manifest, phase, batch=2, capacity=256, seq=seq, single_engine=single)
        by_name = {b.name: b for b in plan}
        for i in range(3):
            for kind in ("key", "value"):
                past, present = by_name[f"past_{kind}.{i}"], by_name[f"present_{kind}.{i}"]
                assert past.buffer == present.buffer == f"{kind}.{i}" and past.is_input and not present.is_input
                assert past.shape == (2, 2, 256, 64)
        assert by_name["input_ids"].shape == (2, seq)
        assert by_name["input_ids"].buffer == ("input_ids" if phase == "prefill" else "decode_ids")
        prefill_graph = phase == "prefill" or single
        assert by_name["logits"].shape == ((2, 1, 512) if prefill_graph else (2, 512)) and not by_name["logits"].is_input
        has_index = phase == "prefill" or single
        assert ("logits_index" in by_name) == has_index
        if phase == "decode" and single:
            assert by_name["logits_index"].buffer == "decode_index" and by_name["logits_index"].shape == (2, 1)
        buffers = [b.buffer for b in plan if b.is_input] + [b.buffer for b in plan if not b.is_input]
        assert len(set(buffers)) == len([b for b in plan if b.is_input]) + 1  # outputs add only logits


def test_binding_plan_for_several_positions() -> None:
    plan = {b.name: b for b in binding_plan(_manifest(), "prefill", 2, 256, 5, False, positions=5)}
    assert plan["logits_index"].shape == (2, 5) and plan["logits"].shape == (2, 5, 512)


def test_graph_keys_follow_slots() -> None:
    assert graph_key(4, 256) == (4, 256) != graph_key(4, 512)


def test_build_without_tensorrt_is_one_line_and_writes_nothing(exported, tmp_path, monkeypatch) -> None:
    import shutil

    from kvforge.core import tensorrt_flavor

    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: [])  # as on a machine without either
    folder = shutil.copytree(exported("llama-tiny", "trt"), tmp_path / "export")
    before = sorted(p.name for p in folder.iterdir())
    result = CliRunner().invoke(main, ["build", str(folder), "--max-batch", "2"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "TensorRT is not installed" in lines[0]
    assert "pip install -e '.[trt-rtx]'" in lines[0] and "pip install -e '.[trt]'" in lines[0]
    assert sorted(p.name for p in folder.iterdir()) == before  # no engines/ folder, no staging
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_build_refuses_an_ort_export_before_anything_else(exported) -> None:
    result = CliRunner().invoke(main, ["build", str(exported("llama-tiny", "ort"))])
    assert result.exit_code == 2 and "export with --target trt or --target onnx" in result.stderr
