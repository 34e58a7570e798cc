"""kvforge runtime: run an export folder (prefill + decode over an in-place KV cache).

Stands alone: imports neither torch, transformers nor onnx (only numpy, onnxruntime, tokenizers,
llguidance).
The names below are imported when first used, so `kvforge.runtime.backends.backend` (the backend registry)
can be read without loading ONNX Runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FinishReason": "kvforge.runtime.controls.request",
    "GenerationRequest": "kvforge.runtime.controls.request",
    "GenerationResult": "kvforge.runtime.drivers.decode_loop",
    "GenerationStream": "kvforge.runtime.drivers.decode_loop",
    "Generator": "kvforge.runtime.drivers.generator",
    "Grammar": "kvforge.runtime.controls.constraint",
    "LoadedExport": "kvforge.runtime.drivers.loaded_export",
    "SamplingConfig": "kvforge.runtime.controls.sampling",
    "Speculation": "kvforge.runtime.controls.request",
    "StepEvent": "kvforge.runtime.drivers.decode_loop",
    "Video": "kvforge.runtime.media.video",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvforge.runtime' has no attribute {name!r}")
