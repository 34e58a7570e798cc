"""Lowering of the cross-attention op (kvforge/core/encoder_contract.py CROSS_OP) per target.

- `ort`: ONNX Runtime's contrib MultiHeadAttention, which takes keys and values heads first [B, H, T, D] and a key
  padding mask given as each row's length [B] (its mask_index form): no mask tensor is built.
- `onnx`: standard Attention (opset 24) over q made heads first, with a boolean mask [B, 1, S, T] (ONNX Runtime's
  CPU Attention refuses a mask that broadcasts over the query positions).

The `trt` target has no cross-attention kernel: an encoder-decoder export refuses it before anything is traced.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.core.encoder_contract import CROSS_OP
from kvforge.core.errors import ExportError
from kvforge.exporter.graph_edit import constant, node_attributes, replace_node

MS_DOMAIN = "com.microsoft"
TARGETS = ("ort", "onnx")


def cross_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [node for node in graph if node.domain == CROSS_OP.domain and node.op_type == CROSS_OP.op_type]


def lower_cross_attention(graph: ir.Graph, target: str) -> int:
    """Rewrite every cross-attention node of `graph` for `target` ("ort" or "onnx"); how many there were."""
    if target not in TARGETS:
        raise ExportError(f"the {target} target has no cross-attention lowering (encoder-decoders: "
                          f"{' or '.join(TARGETS)})")
    nodes = cross_nodes(graph)
    for node in nodes:
        attrs = node_attributes(node)
        q, key, value, lens, *optional = node.inputs
        bias = optional[0] if optional else None
        tape = ir.tape.Tape()
        if target == "ort":
            graph.opset_imports.setdefault(MS_DOMAIN, 1)
            lowest = float(np.finfo(np.float32).min)
            # MultiHeadAttention's inputs: query, key, value, bias (of the projections), key_padding_mask,
            # attention_bias [B|1, H, S, T].
            out = tape.op("MultiHeadAttention", [q, key, value, None, lens, *([bias] if bias is not None else [])],
                          domain=MS_DOMAIN, attributes={"num_heads": attrs["num_heads"], "scale": attrs["scale"],
                                                        "mask_filter_value": lowest, "unidirectional": 0})
        else:
            out = _standard_attention(tape, q, key, value, lens, bias, attrs["num_heads"], attrs["scale"])
        replace_node(graph, node, tape, [out])
    return len(nodes)


def _standard_attention(tape: ir.tape.Tape, q: ir.Value, key: ir.Value, value: ir.Value, lens: ir.Value,
                        bias: ir.Value | None, heads: int, scale: float) -> ir.Value:
    """ONNX Attention of q [B, S, H*D] over K/V [B, H, T, D] masked to each row's length (with `bias` [B|1, H, S, T]
    added where the mask allows: an additive mask); out [B, S, H*D]."""
    split = constant(tape, np.array([0, 0, heads, -1], np.int64))
    query = tape.op("Transpose", [tape.op("Reshape", [q, split])], attributes={"perm": [0, 2, 1, 3]})
    # keep[b, t] = t < lens[b], made [B, 1, S, T]
    keys_shape = tape.op("Shape", [key])
    length = tape.op("Gather", [keys_shape, constant(tape, np.array(2, np.int64))], attributes={"axis": 0})
    positions = tape.op("Range", [constant(tape, np.array(0, np.int64)), length,
                                  constant(tape, np.array(1, np.int64))])
    row_lens = tape.op("Unsqueeze", [tape.op("Cast", [lens], attributes={"to": ir.DataType.INT64}),
                                     constant(tape, np.array([1], np.int64))])
    keep = tape.op("Less", [tape.op("Unsqueeze", [positions, constant(tape, np.array([0], np.int64))]), row_lens])
    keep = tape.op("Unsqueeze", [keep, constant(tape, np.array([1, 2], np.int64))])  # [B, 1, 1, T]
    q_shape = tape.op("Shape", [query])
    batch_one_seq = tape.op("Concat", [tape.op("Slice", [q_shape, constant(tape, np.array([0], np.int64)),
                                                         constant(tape, np.array([1], np.int64))]),
                                       constant(tape, np.array([1], np.int64)),
                                       tape.op("Slice", [q_shape, constant(tape, np.array([2], np.int64)),
                                                         constant(tape, np.array([3], np.int64))]),
                                       tape.op("Slice", [keys_shape, constant(tape, np.array([2], np.int64)),
                                                         constant(tape, np.array([3], np.int64))])],
                            attributes={"axis": 0})
    mask = tape.op("Expand", [keep, batch_one_seq])
    if bias is not None:
        mask = tape.op("Where", [mask, bias, constant(tape, np.array(np.finfo(np.float32).min, np.float32))])
    out = tape.op("Attention", [query, key, value, mask], attributes={"scale": scale})
    merged = constant(tape, np.array([0, 0, -1], np.int64))
    return tape.op("Reshape", [tape.op("Transpose", [out], attributes={"perm": [0, 2, 1, 3]}), merged])
