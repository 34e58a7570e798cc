"""What the exporter needs to know of a target beyond kvforge/core/targets.py (the runtime's and the build's
part): its passes and what its attention op takes. One instance per target module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.core.contract import ATTENTION_INPUTS, ATTENTION_OPTIONAL_INPUTS


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


def alibi_input(node: ir.Node) -> ir.Value | None:
    """The canonical node's optional `alibi_slopes` input ([H] fp32, kvforge.core.contract), None when absent."""
    index = len(ATTENTION_INPUTS) + ATTENTION_OPTIONAL_INPUTS.index("alibi_slopes")
    inputs = list(node.inputs)
    return inputs[index] if len(inputs) > index else None


def alibi_bias(tape: ir.tape.Tape, slopes: ir.Value, query_pos: ir.Value, key_pos: ir.Value, heads: int,
               dtype: ir.DataType | None) -> ir.Value:
    """ALiBi's additive bias [B, H, S, T] = slope_h * (key_pos - query_pos) from query positions [B, 1, S, 1] and
    key positions [T] (int64). HF adds slope_h * key_pos; the softmax of a query row ignores the per-row shift,
    and the relative form stays small at long positions. Computed in fp32, cast to the activations' `dtype`."""
    from kvforge.exporter.graph_edit import constant

    distance = tape.op("Cast", [tape.op("Sub", [key_pos, query_pos])], attributes={"to": ir.DataType.FLOAT})
    per_head = tape.op("Reshape", [slopes, constant(tape, np.array([1, heads, 1, 1], np.int64), None)])
    bias = tape.op("Mul", [per_head, distance])
    if dtype is not None and dtype != ir.DataType.FLOAT:
        bias = tape.op("Cast", [bias], attributes={"to": dtype})
    return bias


def shared_key(value: ir.Value) -> object:
    """A key under which equal constant inputs (every layer's copy of the same slopes) share one computed value."""
    tensor = value.const_value
    return (tensor.numpy().tobytes(), str(tensor.dtype)) if tensor is not None else id(value)
