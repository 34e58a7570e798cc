"""A GGUF file's tensors checked before kvforge reads their values: one line naming a corrupt tensor, for the
whole-file conversion (models/gguf.py) and the carried blocks (exporter/quantization/gguf_blocks.py) alike."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvforge.core.errors import InputError


def finite(tensor: str, what: str, values: np.ndarray) -> None:
    """Refuse a GGUF tensor whose values (or block scales) are NaN or Inf, in one line naming it."""
    bad = ~np.isfinite(values)
    if bad.any():
        raise InputError(f"GGUF tensor {tensor} holds {int(bad.sum())} non-finite {what} (NaN or Inf): the file is "
                         "corrupt; convert or download it again")


def float_type(tensor: Any) -> None:
    """Refuse a GGUF weight stored as integers (I8 ... I64): no block type, nothing a weight's floats come from."""
    kind = tensor.tensor_type.name
    if kind in ("I8", "I16", "I32", "I64"):
        raise InputError(f"GGUF tensor {tensor.name} is of type {kind}: a model weight must be a float or quantised "
                         "block type; the file is corrupt")
