"""Which TensorRT this process uses: standard TensorRT (`tensorrt` >= 10.15) or TensorRT for RTX
(`tensorrt_rtx`). Their Python APIs are the same for what kvforge calls (Builder, OnnxParser, profiles,
Runtime, execution contexts); this module holds the few facts that differ, so the build and the
backend never test a flavour themselves:

- TensorRT-RTX builds ahead of time on the CPU (no GPU needed) for a portable set of compute
  capabilities, and specialises the engine on the GPU when it is loaded; standard TensorRT builds on
  and for the GPU it runs on.
- TensorRT-RTX has no `tensorrt.plugin` (quickly deployable plugins), so kvforge's plugin, which is
  embedded ahead of time through that module, cannot be built there.

Nothing here imports TensorRT until `load_tensorrt()` is called.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

from kvforge.core.errors import BackendUnavailableError

FLAVORS = ("tensorrt", "tensorrt-rtx")
_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_LABELS = {"tensorrt": "TensorRT", "tensorrt-rtx": "TensorRT-RTX"}
_MINIMUM = {"tensorrt": (10, 15), "tensorrt-rtx": (1, 7)}
# Where an engine built by TensorRT-RTX without an explicit target runs (its documented default).
RTX_PORTABLE = "8.0, 8.6, 8.9, 12.0+"
# The compute capabilities whose GPUs each flavour's runtime runs engines on. TensorRT-RTX's own words on
# an H200 (9.0): "Supported compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0. TensorRT-RTX does not
# support this compute capability, so the engine cannot be rebuilt for it." Standard TensorRT 10: Turing on.
_RTX_RUNS_ON = ((8, 0), (8, 6), (8, 9))
_STANDARD_OLDEST = (7, 5)
_INSTALL_HINT = (
    "pip install -e '.[trt-rtx]' (TensorRT for RTX: builds engines on any machine, CPU included) or, on a "
    "machine with an NVIDIA GPU, pip install -e '.[trt]' (TensorRT >= 10.15)"
)


@dataclass(frozen=True)
class TensorRT:
    """The TensorRT module in use and what kvforge needs to know about it."""

    flavor: str  # "tensorrt" or "tensorrt-rtx"
    module: Any
    version: str

    @property
    def label(self) -> str:
        return f"{_LABELS[self.flavor]} {self.version}"

    @property
    def builds_without_gpu(self) -> bool:
        return self.flavor == "tensorrt-rtx"

    @property
    def has_timing_cache(self) -> bool:
        return self.flavor == "tensorrt"  # TensorRT-RTX keeps the API, but its timing cache does nothing

    def plugin_module(self) -> Any | None:
        """`tensorrt.plugin` (quickly deployable plugins, with ahead-of-time kernels), or None where this
        flavour has none."""
        try:
            return importlib.import_module(f"{_MODULES[self.flavor]}.plugin")
        except ImportError:
            return None

    def record(self) -> dict[str, str]:
        """What engines.json keeps: engines load only on the flavour and version that built them."""
        return {"flavor": self.flavor, "version": self.version}


def _capability(compute_capability: str) -> tuple[int, int]:
    major, _, minor = str(compute_capability).partition(".")
    return int(major), int(minor or 0)


def runs_on(flavor: str, compute_capability: str) -> bool:
    """Whether `flavor`'s runtime runs engines on a GPU of this compute capability ("9.0")."""
    cc = _capability(compute_capability)
    if flavor == "tensorrt-rtx":
        return cc in _RTX_RUNS_ON or cc[0] >= 12
    return cc >= _STANDARD_OLDEST


def runs_on_summary(flavor: str) -> str:
    return RTX_PORTABLE if flavor == "tensorrt-rtx" else f"{'.'.join(map(str, _STANDARD_OLDEST))} and newer"


def gpu_refusal(flavor: str, gpu: dict[str, str]) -> str | None:
    """Why `flavor`'s engines cannot run on `gpu` ({name, compute_capability}), with what does run there;
    None when they can. A rebuild never helps: the runtime itself refuses the architecture."""
    if runs_on(flavor, gpu["compute_capability"]):
        return None
    where = f"{gpu.get('name', 'this GPU')} (compute capability {gpu['compute_capability']})"
    if flavor == "tensorrt-rtx":
        return (f"{_LABELS[flavor]} engines cannot run on {where}: TensorRT-RTX runs only on compute capability "
                f"{RTX_PORTABLE}, and no rebuild changes that. On this GPU use standard TensorRT (pip install "
                "-e '.[trt]', then kvforge build --tensorrt tensorrt) or --backend ort-cuda with an ort-target "
                "export (kvforge export --target ort --dtype fp16)")
    return (f"{_LABELS[flavor]} does not run on {where} (it needs compute capability "
            f"{runs_on_summary(flavor)}); use --backend ort-cuda with an ort-target export")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def installed_flavors() -> list[str]:
    """The flavours whose Python module is installed (nothing imported)."""
    return [flavor for flavor in FLAVORS
            if _MODULES[flavor] in sys.modules or importlib.util.find_spec(_MODULES[flavor]) is not None]


def load_tensorrt(flavor: str = "auto") -> TensorRT:
    """Import TensorRT: `flavor` "tensorrt" or "tensorrt-rtx", or "auto" (standard TensorRT where it is
    installed, it runs kvforge's plugin; else TensorRT-RTX). Raises one clear error naming what to install."""
    if flavor not in (*FLAVORS, "auto"):
        raise BackendUnavailableError(f"unknown TensorRT flavour {flavor!r}; choose auto, {', '.join(FLAVORS)}")
    found = installed_flavors()
    if flavor == "auto":
        if not found:
            raise BackendUnavailableError(f"TensorRT is not installed: {_INSTALL_HINT}")
        flavor = found[0]
    elif flavor not in found:
        raise BackendUnavailableError(
            f"{_LABELS[flavor]} ({_MODULES[flavor]}) is not installed"
            + (f" (installed: {', '.join(found)})" if found else "") + f": {_INSTALL_HINT}"
        )
    module = importlib.import_module(_MODULES[flavor])
    version = str(module.__version__)
    if _version_tuple(version) < _MINIMUM[flavor]:
        raise BackendUnavailableError(
            f"kvforge needs {_LABELS[flavor]} >= {'.'.join(map(str, _MINIMUM[flavor]))} (its ONNX parser imports "
            f"Attention and TensorScatter), found {version}"
        )
    return TensorRT(flavor, module, version)
