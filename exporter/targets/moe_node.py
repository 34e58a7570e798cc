"""The canonical MoE node (kvforge.core.contract.MOE_OP, defined by plugins/moe_op.py) as the exporter reads it:
where it is in a graph, and its inputs and attributes by role. Its lowerings are moe_ort.py and moe_plain.py."""

from __future__ import annotations

import onnx_ir as ir

from kvforge.core.contract import MOE_OP


def moe_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The graph's canonical MoE nodes (kvforge.core.contract.MOE_OP; plugins/moe_op.py)."""
    return [node for node in graph if node.domain == MOE_OP.domain and node.op_type == MOE_OP.op_type]


def moe_parts(node: ir.Node) -> tuple[list[ir.Value], ir.Value | None, ir.Value | None, tuple[float, float, float]]:
    """A MoE node's (hidden, top_k_index, top_k_weights, gate_up, down), its two biases (None when absent) and
    its (activation_alpha, activation_beta, swiglu_limit)."""
    inputs = list(node.inputs)
    biases = (inputs[5], inputs[6]) if len(inputs) > 5 else (None, None)
    attrs = tuple(float(node.attributes[name].value) for name in ("activation_alpha", "activation_beta",
                                                                     "swiglu_limit"))
    return inputs[:5], biases[0], biases[1], attrs
