"""`kvforge build --plugin-shared-mem KIB` and `--arch SM`: from the command line through build_engines and the
build options (engines.json's "options", the build key) to the plugin's registration, without TensorRT.

The compile itself (a variant within the cap) is tested in tests/engines/test_trt_plugin.py."""

from __future__ import annotations

import json
import types

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.engine_plan import ENGINES_MANIFEST, build_key, engines_manifest, resolve_build_options
from kvforge.core.errors import InputError
from kvforge.core.targets import get_target


def _manifest(target: str = "trt") -> dict:
    names = ["input_ids", "past_lens"] + [f"past_{k}.0" for k in ("key", "value")]
    return {
        "target": target, "dtype": "fp16",
        "model": {"vocab_size": 64, "num_heads": 4},
        "kv_cache": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 64, "max_capacity": 512, "dtype": "float16"},
        "graphs": {phase: {"file": f"{phase}.onnx", "inputs": [{"name": n} for n in names]}
                   for phase in ("prefill", "decode")},
        "files": {"prefill.onnx": {"sha256": "a", "bytes": 1}, "decode.onnx": {"sha256": "b", "bytes": 1}},
    }


def test_the_cap_is_a_build_option_in_engines_json_and_the_key(tmp_path) -> None:
    manifest = _manifest()
    capped = resolve_build_options(manifest, get_target("trt"), plugin_shared_kib=48)
    default = resolve_build_options(manifest, get_target("trt"))
    assert capped.plugin_shared_kib == 48 and default.plugin_shared_kib is None
    trt = {"flavor": "tensorrt", "version": "10.15.1"}
    assert build_key(manifest, capped, trt, "9.0", "0.1.0") != build_key(manifest, default, trt, "9.0", "0.1.0")
    (tmp_path / "kvforge.json").write_text("{}")
    gpu = {"name": "GPU", "compute_capability": "9.0"}
    record = engines_manifest(tmp_path, manifest, get_target("trt"), capped, "k", trt, gpu, {}, 1.0, "0.1.0")
    assert record["options"]["plugin_shared_kib"] == 48
    with pytest.raises(InputError, match="--plugin-shared-mem must be a positive integer, got 0"):
        resolve_build_options(manifest, get_target("trt"), plugin_shared_kib=0)
    with pytest.raises(InputError, match="an export for the onnx target does not use"):
        resolve_build_options(_manifest("onnx"), get_target("onnx"), plugin_shared_kib=48)


def test_kvforge_build_hands_the_cap_to_the_plugin_and_records_it(monkeypatch, tmp_path) -> None:
    # TensorRT and the GPU are stood in for; everything between the flag and them runs.
    from kvforge.engines import trt_build
    from kvforge.plugins import trt_plugin

    export = tmp_path / "export"
    export.mkdir()
    (export / "kvforge.json").write_text("{}")
    registered: list[int | None] = []
    monkeypatch.setattr(trt_build, "load_manifest", lambda folder: _manifest())
    trt = types.SimpleNamespace(label="TensorRT 10.15.1", record=lambda: {"flavor": "tensorrt", "version": "10.15.1"})
    monkeypatch.setattr(trt_build, "load_tensorrt", lambda flavor: trt)
    monkeypatch.setattr(trt_build, "_plugin_identity", lambda trt, manifest: {"kernel_source": "k", "triton": "t"})
    monkeypatch.setattr(trt_build, "build_target", lambda trt, say=None: {"name": "GPU", "compute_capability": "9.0"})
    monkeypatch.setattr(trt_build, "_build_one", lambda *args: (b"engine", b"timing", "plugin"))
    monkeypatch.setattr(trt_plugin, "register",
                        lambda max_shared_kib=None, arch=None: registered.append(max_shared_kib))
    result = CliRunner().invoke(main, ["build", str(export), "--plugin-shared-mem", "48", "--json"])
    assert result.exit_code == 0, result.output
    assert registered == [48]
    assert json.loads(result.stdout)["options"]["plugin_shared_kib"] == 48
    on_disk = json.loads((export / "engines" / ENGINES_MANIFEST).read_text())
    assert on_disk["options"]["plugin_shared_kib"] == 48
    # Same options: reused. Without the cap: another build key, so rebuilt with the plugin uncapped.
    assert CliRunner().invoke(main, ["build", str(export), "--plugin-shared-mem", "48"]).exit_code == 0
    assert registered == [48]
    assert CliRunner().invoke(main, ["build", str(export)]).exit_code == 0
    assert registered == [48, None]


def test_kvforge_build_hands_the_architecture_to_the_plugin(monkeypatch, tmp_path) -> None:
    # The plugin's PTX architecture is a build option, not an environment variable.
    from kvforge.engines import trt_build
    from kvforge.plugins import trt_plugin

    export = tmp_path / "export"
    export.mkdir()
    (export / "kvforge.json").write_text("{}")
    target = {"name": "trt"}
    registered: list[tuple] = []
    monkeypatch.setattr(trt_build, "load_manifest", lambda folder: _manifest(target["name"]))
    trt = types.SimpleNamespace(label="TensorRT 10.15.1", record=lambda: {"flavor": "tensorrt", "version": "10.15.1"},
                                builds_without_gpu=False, plugin_module=lambda: object())
    monkeypatch.setattr(trt_build, "load_tensorrt", lambda flavor: trt)
    monkeypatch.setattr(trt_build, "_plugin_identity", lambda trt, manifest: {"kernel_source": "k", "triton": "t"})
    monkeypatch.setattr(trt_build, "build_target", lambda trt, say=None: {"name": "GPU", "compute_capability": "9.0"})
    monkeypatch.setattr(trt_build, "_build_one", lambda *args: (b"engine", b"timing", "plugin"))
    monkeypatch.setattr(trt_plugin, "register", lambda max_shared_kib=None, arch=None: registered.append((max_shared_kib, arch)))
    result = CliRunner().invoke(main, ["build", str(export), "--arch", "sm_80", "--json"])
    assert result.exit_code == 0, result.output
    assert registered == [(None, "sm_80")]
    # Other PTX, other engines: another architecture is not "up to date".
    assert CliRunner().invoke(main, ["build", str(export), "--arch", "sm_80"]).exit_code == 0
    assert registered == [(None, "sm_80")]
    assert CliRunner().invoke(main, ["build", str(export), "--arch", "sm_90"]).exit_code == 0
    assert registered == [(None, "sm_80"), (None, "sm_90")]
    result = CliRunner().invoke(main, ["build", str(export), "--arch", "hopper"])
    assert result.exit_code != 0 and "--arch: the plugin's GPU architecture must look like sm_90, got 'hopper'" in result.output
    target["name"] = "onnx"
    result = CliRunner().invoke(main, ["build", str(export), "--arch", "sm_90"])
    assert result.exit_code != 0 and "an export for the onnx target does not use the plugin" in result.output
