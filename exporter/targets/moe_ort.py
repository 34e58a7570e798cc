"""The `ort` target's MoE lowering: each canonical MoE node (plugins/moe_op.py) becomes ONNX Runtime's fused
com.microsoft.MoE, or com.microsoft.QMoE with the experts' weights int4 (exporter/quantization/experts.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.core.errors import ExportError
from kvforge.exporter.graph_edit import constant as _const
from kvforge.exporter.graph_edit import replace_node as _replace
from kvforge.exporter.quantization.experts import INT8_EXPERTS, quantized_initializer
from kvforge.exporter.targets.moe_node import moe_nodes, moe_parts


def lower_moe_to_ort(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    """com.microsoft.MoE per node (com.microsoft.QMoE with `quantize` = (4, block_size): the experts'
    weights int4, block-wise symmetric; see INT8_EXPERTS for int8). The op routes by itself (softmax over router logits,
    top-k), so it is handed logits whose softmax is HF's own top-k weights over their sum: log(w) at the
    picked experts, -inf elsewhere; the result is scaled back by that sum (the experts are linear in
    their weights)."""
    if quantize is not None and quantize[0] != 4:
        raise ExportError(INT8_EXPERTS)
    nodes = moe_nodes(graph)
    for node in nodes:
        (hidden, index, weights, gate_up, down), gate_up_bias, down_bias, (alpha, beta, limit) = moe_parts(node)
        experts, k = gate_up.shape[0] if gate_up.shape else None, index.shape[1] if index.shape else None
        if not isinstance(experts, int) or not isinstance(k, int):
            raise ExportError(f"MoE node {node.name}: the expert count and top-k must be static for ONNX Runtime's MoE")
        dtype = weights.dtype.numpy() if weights.dtype is not None else np.float32
        tape = ir.tape.Tape()
        rows = tape.op("Shape", [index], attributes={"start": 0, "end": 1})
        shape = tape.op("Concat", [rows, _const(tape, np.array([experts], np.int64))], attributes={"axis": 0})
        blocked = tape.op("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.array([-np.inf], dtype))})
        # A pick of weight 0 (an identity expert's pick, see exporter/experts_routing.py: _looped_forward, run as a
        # routed expert at weight 0) is floored to the dtype's tiny, so that a token whose picks are all weight 0
        # does not softmax -inf alone (NaN); where it repeats another pick of that token's, "max" keeps the real one.
        floored = tape.op("Max", [weights, _const(tape, np.array(np.finfo(dtype).tiny, dtype))])
        logits = tape.op("ScatterElements", [blocked, index, tape.op("Log", [floored])],
                         attributes={"axis": 1, "reduction": "max"})
        total = tape.op("ReduceSum", [weights, _const(tape, np.array([1], np.int64))], attributes={"keepdims": 1})
        if hidden.dtype is not None and weights.dtype not in (None, hidden.dtype):
            # Mixtral's router hands on its weights in fp32 beside fp16 / bf16 hidden states; ONNX Runtime's MoE
            # takes one type for both (the routing above stays in the weights' precision).
            logits = tape.op("Cast", [logits], attributes={"to": hidden.dtype.value})
            total = tape.op("Cast", [total], attributes={"to": hidden.dtype.value})
        attributes: dict[str, Any] = {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1,
                                      "activation_alpha": alpha, "activation_beta": beta,
                                      "normalize_routing_weights": 0}
        if limit > 0.0:
            attributes["swiglu_limit"] = limit
        if quantize is not None:
            bits, block_size = quantize
            if gate_up.const_value is None or down.const_value is None:
                raise ExportError(f"MoE node {node.name}: the experts' weights are not constants; cannot quantise them")
            if gate_up.shape[2] % block_size or down.shape[2] % block_size:
                raise ExportError(f"MoE node {node.name}: the experts' input sizes ({gate_up.shape[2]}, "
                                  f"{down.shape[2]}) are not multiples of --block-size {block_size}")
            fc1, fc1_scales = quantized_initializer(graph, gate_up, bits, block_size)
            fc2, fc2_scales = quantized_initializer(graph, down, bits, block_size)
            attributes.update(expert_weight_bits=bits, block_size=block_size)
            fused = tape.op("QMoE", [hidden, logits, fc1, fc1_scales, gate_up_bias, fc2, fc2_scales, down_bias],
                            attributes=attributes, domain="com.microsoft")
        else:
            fused = tape.op("MoE", [hidden, logits, gate_up, gate_up_bias, down, down_bias], attributes=attributes,
                            domain="com.microsoft")
        _replace(graph, node, tape, [tape.op("Mul", [fused, total])])
    if nodes:
        graph.opset_imports["com.microsoft"] = 1
    return len(nodes)
