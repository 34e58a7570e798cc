"""What the exporter needs to know of a target beyond kvforge/core/targets.py (the runtime's and the build's
part): its passes and what its attention op takes. One instance per target module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExportTarget:
    name: str
    # (graph, canonical attention nodes, rotary cos/sin caches or None, per-layer KV scales or None): rewrites
    # every canonical node in place. A target whose fusions it does not run ignores `rotary`.
    lower_attention: Callable[..., Any]
    # (graph, (bits, block size) for the experts' weights or None): rewrites the canonical MoE nodes.
    lower_moe: Callable[..., Any]
    # ONNX Runtime's contrib fusions (normalization, rotary folded into the attention op).
    ort_fusions: bool = False
    quantize: bool = False  # `--quantize` (MatMulNBits, an ONNX Runtime contrib op)
    # `--kv-cache` dtypes its attention op reads and writes.
    kv_cache_dtypes: tuple[str, ...] = ()
    # The export checks the model's attention shapes against kvforge's own kernel.
    kernel_shapes: bool = False
    # The head sizes its attention op takes are multiples of this.
    head_dim_multiple: int = 1
