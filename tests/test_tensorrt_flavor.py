"""kvforge/tensorrt_flavor.py: which TensorRT is used, and one clear error when the wanted one is missing."""

from __future__ import annotations

import sys
import types

import pytest

from kvforge import tensorrt_flavor
from kvforge.errors import BackendUnavailableError
from kvforge.tensorrt_flavor import load_tensorrt


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
    with pytest.raises(BackendUnavailableError, match=r"TensorRT is not installed: pip install 'kvforge\[trt-rtx\]'"):
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
