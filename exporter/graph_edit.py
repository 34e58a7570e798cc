"""Graph editing the target lowerings share (onnx-ir): the canonical attention nodes, constants, node
replacement, and the patterns around attention that a lowering folds (RoPE right before it, q/k/v as the
parts of one MatMul)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.core.contract import CANONICAL_OP

DOMAIN = CANONICAL_OP.domain  # the canonical node's domain, dropped from the graph once lowered
# The metadata key a merged MatMul's constant carries: the weights it joins, in order (fusions.py writes it; an
# import of integer weights, quantization/exact_blocks.py, finds each part's integers by it).
PARTS_META = "kvforge_parts"


def constant(tape: ir.tape.Tape, array: np.ndarray, name: str | None = None) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(array, name=name)})


def node_attributes(node: ir.Node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


def canonical_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [node for node in graph if node.domain == CANONICAL_OP.domain and node.op_type == CANONICAL_OP.op_type]


def replace_node(graph: ir.Graph, node: ir.Node, tape: ir.tape.Tape, new_outputs: list[ir.Value]) -> None:
    ir.convenience.replace_nodes_and_values(
        graph, node, [node], tape.nodes, list(node.outputs), new_outputs
    )


def take_over(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    """`value` (computed by nodes already inserted) takes the place of `node`'s one output: its type and shape,
    its uses and, where it is a graph output, its name; then `node` is removed."""
    old = node.outputs[0]
    if old.dtype is not None:  # (a fusion's MatMul may have none: the graph's type inference has it)
        value.dtype, value.shape = old.dtype, old.shape
    old.replace_all_uses_with(value, replace_graph_outputs=True)
    if value.is_graph_output():
        old.name, value.name = None, old.name
    graph.remove(node, safe=True)


FUSION_DOMAIN = "ai.onnxruntime._fusion"  # onnxscript's intermediate RotaryEmbedding (exporter/fusions.py)
TRANSPOSE_BSHD = [0, 2, 1, 3]  # [B, S, H, D] <-> [B, H, S, D]


def attention_inputs(node: ir.Node) -> tuple[list[ir.Value], ir.Value | None]:
    """The canonical node's ATTENTION_INPUTS and its optional `sinks` input (None when absent)."""
    inputs = list(node.inputs)
    return inputs[:6], (inputs[6] if len(inputs) > 6 else None)


def producer_of(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == domain else None


def transpose_perm(node: ir.Node | None) -> list[int] | None:
    return list(node.attributes["perm"].value) if node is not None and "perm" in node.attributes else None


def pre_rotary(value: ir.Value) -> tuple[ir.Value, ir.Node] | None:
    """If a canonical q/k input is Reshape(Transpose(RotaryEmbedding(Transpose(y)))) -- RoPE applied
    in the [B, H, S, D] layout to y [B, S, H, D] -- return y and the rotary node."""
    reshape = producer_of(value, "Reshape")
    back = producer_of(reshape.inputs[0], "Transpose") if reshape is not None else None
    if transpose_perm(back) != TRANSPOSE_BSHD:
        return None
    # onnxscript's intermediate RotaryEmbedding, or ONNX Runtime's own where its cos/sin fusion already ran
    # (transformers 5.17's trace). Either way the table is the model's (rotary_caches checks it against the
    # module at every position) and the positions are past_lens + t: GQA's do_rotary computes the same.
    rotary = producer_of(back.inputs[0], "RotaryEmbedding", FUSION_DOMAIN) or \
        producer_of(back.inputs[0], "RotaryEmbedding", "com.microsoft")
    if rotary is None or rotary.attributes.get("interleaved", ir.AttrInt64("interleaved", 0)).value != 0 or \
            rotary.attributes.get("rotary_embedding_dim", ir.AttrInt64("rotary_embedding_dim", 0)).value != 0 or \
            rotary.attributes.get("scale", ir.AttrFloat32("scale", 1.0)).value != 1.0:
        return None
    forward = producer_of(rotary.inputs[0], "Transpose")
    if transpose_perm(forward) != TRANSPOSE_BSHD:
        return None
    return forward.inputs[0], rotary


def split_output(value: ir.Value) -> tuple[ir.Node, int] | None:
    """The Split node and output index `value` is, looking through Reshapes and cancelling pairs of
    [B,S,H,D] <-> [B,H,S,D] transposes (layout only, no data change)."""
    transposes = 0
    while True:
        node = value.producer()
        if node is None:
            return None
        if node.op_type == "Reshape" and node.domain == "":
            value = node.inputs[0]
        elif node.op_type == "Transpose" and node.domain == "" and transpose_perm(node) == TRANSPOSE_BSHD:
            transposes += 1
            value = node.inputs[0]
        elif node.op_type == "Split" and node.domain == "" and transposes % 2 == 0:
            return node, list(node.outputs).index(value)
        else:
            return None
