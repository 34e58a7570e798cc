"""The exporter's side of each target, one module each (its attention lowering, its MoE lowering, its
fusions and what its attention op takes), registered here by name. kvforge/core/targets.py holds the
part the runtime and the engine build read; a new target is an entry there, a module here, and its line
in EXPORT_TARGETS."""

from __future__ import annotations

from kvforge.core.errors import InputError
from kvforge.exporter.targets import onnx, ort, trt
from kvforge.exporter.targets.base import ExportTarget

# Each target is handed the others here, where they are all known (its refusals name them), rather than
# exporter/targets/base.py importing this registry back.
_DEFINED = (ort.TARGET, onnx.TARGET, trt.TARGET)
EXPORT_TARGETS: dict[str, ExportTarget] = {target.name: target.among(_DEFINED) for target in _DEFINED}


def export_target(name: str) -> ExportTarget:
    try:
        return EXPORT_TARGETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown target {name!r}; choose one of {', '.join(EXPORT_TARGETS)}") from None


__all__ = ["EXPORT_TARGETS", "ExportTarget", "export_target"]
