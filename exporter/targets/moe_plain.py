"""The `onnx` and `trt` targets' MoE lowering: each canonical MoE node (plugins/moe_op.py) becomes standard ONNX
that gathers the picked experts' weights and runs only those."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.exporter.graph_edit import constant as _const
from kvforge.exporter.graph_edit import replace_node as _replace
from kvforge.exporter.targets.moe_node import moe_nodes, moe_parts


def lower_moe_to_plain(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    """Standard ONNX: gather each token's k experts' weights, two batched MatMuls, the activation, the
    weighted sum. Only the picked experts run (each token copies k weight matrices)."""
    nodes = moe_nodes(graph)
    for node in nodes:
        (hidden, index, weights, gate_up, down), gate_up_bias, down_bias, (alpha, beta, limit) = moe_parts(node)
        dtype = weights.dtype.numpy() if weights.dtype is not None else np.float32
        tape = ir.tape.Tape()
        x = tape.op("Unsqueeze", [hidden, _const(tape, np.array([1, 3], np.int64))])  # [N, 1, H, 1]
        z = tape.op("MatMul", [tape.op("Gather", [gate_up, index]), x])  # [N, k, 2I, 1]
        z = tape.op("Squeeze", [z, _const(tape, np.array([3], np.int64))])
        if gate_up_bias is not None:
            z = tape.op("Add", [z, tape.op("Gather", [gate_up_bias, index])])

        gate, up = (tape.op("Slice", [z, _const(tape, np.array([start], np.int64)),
                                      _const(tape, np.array([np.iinfo(np.int64).max], np.int64)),
                                      _const(tape, np.array([2], np.int64)), _const(tape, np.array([2], np.int64))])
                    for start in (0, 1))  # the interleaved gate and up rows
        if limit > 0.0:
            gate = tape.op("Min", [gate, _const(tape, np.array(limit, dtype))])
            up = tape.op("Clip", [up, _const(tape, np.array(-limit, dtype)), _const(tape, np.array(limit, dtype))])
        scaled = tape.op("Mul", [gate, _const(tape, np.array(alpha, dtype))]) if alpha != 1.0 else gate
        act = tape.op("Mul", [tape.op("Mul", [gate, tape.op("Sigmoid", [scaled])]),
                              tape.op("Add", [up, _const(tape, np.array(beta, dtype))]) if beta != 0.0 else up])
        act = tape.op("Unsqueeze", [act, _const(tape, np.array([3], np.int64))])  # [N, k, I, 1]
        y = tape.op("Squeeze", [tape.op("MatMul", [tape.op("Gather", [down, index]), act]),
                                _const(tape, np.array([3], np.int64))])  # [N, k, H]
        if down_bias is not None:
            y = tape.op("Add", [y, tape.op("Gather", [down_bias, index])])
        weighted = tape.op("Mul", [y, tape.op("Unsqueeze", [weights, _const(tape, np.array([2], np.int64))])])
        out = tape.op("ReduceSum", [weighted, _const(tape, np.array([1], np.int64))], attributes={"keepdims": 0})
        _replace(graph, node, tape, [out])
    return len(nodes)
