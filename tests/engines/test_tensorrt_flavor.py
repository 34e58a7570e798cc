"""kvforge/core/tensorrt_flavor.py: which TensorRT is used, and one clear error when the wanted one is missing."""

from __future__ import annotations

import sys
import types

import pytest

from kvforge.core import tensorrt_flavor
from kvforge.core.errors import BackendUnavailableError
from kvforge.core.tensorrt_flavor import load_tensorrt


def _fake(monkeypatch, name: str, version: str, plugin: bool = False) -> None:
    module = types.ModuleType(name)
    module.__version__ = version
    monkeypatch.setitem(sys.modules, name, module)
    if plugin:
        monkeypatch.setitem(sys.modules, f"{name}.plugin", types.ModuleType(f"{name}.plugin"))


def test_auto_prefers_standard_tensorrt_and_falls_back_to_rtx(monkeypatch) -> None:
    _fake(monkeypatch, "tensorrt_rtx", "1.7.1.116")
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt-rtx"])
    rtx = load_tensorrt()
    assert (rtx.flavor, rtx.version, rtx.label) == ("tensorrt-rtx", "1.7.1.116", "TensorRT-RTX 1.7.1.116")
    assert rtx.builds_without_gpu and not rtx.has_timing_cache
    assert rtx.record() == {"flavor": "tensorrt-rtx", "version": "1.7.1.116"}
    _fake(monkeypatch, "tensorrt", "10.15.1", plugin=True)
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt", "tensorrt-rtx"])
    standard = load_tensorrt()
    assert standard.flavor == "tensorrt" and not standard.builds_without_gpu
    assert standard.plugin_module() is sys.modules["tensorrt.plugin"]
    assert load_tensorrt("tensorrt-rtx").flavor == "tensorrt-rtx"


def test_missing_or_old_tensorrt_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: [])
    with pytest.raises(BackendUnavailableError, match=r"TensorRT is not installed: pip install -e '\.\[trt-rtx\]'"):
        load_tensorrt()
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt-rtx"])
    with pytest.raises(BackendUnavailableError, match=r"TensorRT \(tensorrt\) is not installed \(installed: tensorrt-rtx\)"):
        load_tensorrt("tensorrt")
    with pytest.raises(BackendUnavailableError, match="unknown TensorRT flavour 'trt'"):
        load_tensorrt("trt")
    _fake(monkeypatch, "tensorrt", "10.13.0")
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt"])
    with pytest.raises(BackendUnavailableError, match="needs TensorRT >= 10.15 .* found 10.13.0"):
        load_tensorrt()


def test_rtx_has_no_plugin_module() -> None:
    pytest.importorskip("tensorrt_rtx")
    rtx = load_tensorrt("tensorrt-rtx")
    assert rtx.plugin_module() is None  # no tensorrt.plugin: kvforge's plugin cannot be embedded there


@pytest.mark.parametrize(("flavor", "capability", "runs"), [
    ("tensorrt-rtx", "8.0", True), ("tensorrt-rtx", "8.6", True), ("tensorrt-rtx", "8.9", True),
    ("tensorrt-rtx", "12.0", True), ("tensorrt-rtx", "12.1", True), ("tensorrt-rtx", "9.0", False),
    ("tensorrt-rtx", "7.5", False), ("tensorrt-rtx", "8.7", False), ("tensorrt", "9.0", True),
    ("tensorrt", "7.5", True), ("tensorrt", "7.0", False)])
def test_which_gpus_each_flavour_runs_engines_on(flavor, capability, runs) -> None:
    # TensorRT-RTX 1.7's own refusal on an H200: "Supported compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0".
    assert tensorrt_flavor.runs_on(flavor, capability) is runs
    refusal = tensorrt_flavor.gpu_refusal(flavor, {"name": "NVIDIA H200", "compute_capability": capability})
    assert (refusal is None) is runs


def test_a_refusal_names_the_gpu_and_what_runs_there_never_a_rebuild() -> None:
    refusal = tensorrt_flavor.gpu_refusal("tensorrt-rtx", {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"})
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in refusal
    assert "8.0, 8.6, 8.9, 12.0+" in refusal and "--backend ort-cuda" in refusal and "standard TensorRT" in refusal
    assert "no rebuild changes that" in refusal and "kvforge build --force" not in refusal


def test_an_rtx_build_on_a_gpu_it_cannot_run_says_so_and_builds_for_the_portable_set(monkeypatch) -> None:
    from kvforge.engines import trt_build

    _fake(monkeypatch, "tensorrt_rtx", "1.7.1.116")
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt-rtx"])
    rtx = load_tensorrt()
    said: list[str] = []
    monkeypatch.setattr(trt_build, "local_gpu", lambda: {"name": "NVIDIA H200", "compute_capability": "9.0"})
    target = trt_build.build_target(rtx, said.append)
    assert target["compute_capability"] == tensorrt_flavor.RTX_PORTABLE
    assert len(said) == 1 and "cannot run on NVIDIA H200 (compute capability 9.0)" in said[0]
    said.clear()
    monkeypatch.setattr(trt_build, "local_gpu", lambda: {"name": "NVIDIA L40S", "compute_capability": "8.9"})
    trt_build.build_target(rtx, said.append)
    monkeypatch.setattr(trt_build, "local_gpu", lambda: None)  # a CPU machine: nothing to say
    trt_build.build_target(rtx, said.append)
    assert said == []
