"""kvforge runtime: run an export folder (prefill + decode over an in-place KV cache).

Stands alone: imports neither torch, transformers nor onnx (only numpy, onnxruntime, tokenizers,
llguidance).
The names below are imported when first used, so `kvforge.runtime.backend` (the backend registry)
can be read without loading ONNX Runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FinishReason": "kvforge.runtime.request",
    "GenerationRequest": "kvforge.runtime.request",
    "GenerationResult": "kvforge.runtime.decode_loop",
    "GenerationStream": "kvforge.runtime.decode_loop",
    "Generator": "kvforge.runtime.generator",
    "Grammar": "kvforge.runtime.constraint",
    "LoadedExport": "kvforge.runtime.loaded_export",
    "SamplingConfig": "kvforge.runtime.sampling",
    "Speculation": "kvforge.runtime.request",
    "StepEvent": "kvforge.runtime.decode_loop",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvforge.runtime' has no attribute {name!r}")
