"""An `onnx`-target graph as TensorRT's ONNX parser needs it, rewritten in memory at build time (the
export on disk stays the portable graph; the weights are never copied):

- **Static capacity.** TensorScatter becomes TensorRT's KV-cache-update layer, which needs the cache's
  capacity dimension fixed at build time: every past_*/present_* capacity becomes --max-seq-len.
- **Softcapped attention decomposed.** TensorRT's attention layer has no softcap (its parser refuses
  ONNX Attention with `softcap`): those nodes (Gemma 2) become MatMul -> Tanh softcap -> masked
  Softmax -> MatMul, grouped-query heads kept grouped (no K/V repeat). Other Attention nodes stay
  TensorRT attention layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir


def tensorrt_graph(path: Path, cache_names: set[str], capacity: int | None, heads: int,
                   kv_heads: int, head_dim: int | None) -> tuple[onnx.ModelProto, int]:
    """The graph at `path` (external data left where it is) with `cache_names`' capacity dimension set
    to `capacity` (None: left dynamic) and softcapped Attention decomposed; also how many nodes were
    decomposed. The head counts come from the manifest: the exported graph does not carry q's shape (None: the
    layers differ)."""
    proto = onnx.load(str(path), load_external_data=False)
    if capacity is not None:
        for value in [*proto.graph.input, *proto.graph.output]:
            if value.name in cache_names:
                dim = value.type.tensor_type.shape.dim[2]
                dim.ClearField("dim_param")
                dim.dim_value = capacity
    model = ir.serde.deserialize_model(proto)
    decomposed = 0
    for node in list(model.graph):
        if node.op_type == "Attention" and node.domain == "" and _float_attr(node, "softcap") > 0:
            if head_dim is None:  # the decomposition reshapes by one head layout for every layer
                raise ValueError("softcapped attention in a model whose layers differ in head size cannot be "
                                 "decomposed for TensorRT")
            _decompose(model.graph, node, heads, kv_heads, head_dim)
            decomposed += 1
    return (ir.serde.serialize_model(model) if decomposed else proto), decomposed


def _float_attr(node: ir.Node, name: str, default: float = 0.0) -> float:
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else default


def _const(tape: ir.tape.Tape, array: np.ndarray) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(array)})


def _decompose(graph: ir.Graph, node: ir.Node, heads: int, kv_heads: int, head_dim: int) -> None:
    """Attention(q [B,H,S,D], k/v [B,Hkv,C,D], mask bool [B,1,S,C]) with scale and softcap, as plain ops.
    The query heads of one KV head are one group (ONNX Attention's GQA): q is viewed as
    [B, Hkv, G, S, D] against k/v [B, Hkv, 1, C, D], so the cache is read once per KV head."""
    if len(node.inputs) != 4 or node.inputs[3] is None:
        raise ValueError(f"cannot decompose {node.name}: expected q, k, v and a boolean mask")
    q, k, v, mask = node.inputs
    dtype = k.dtype.numpy() if k.dtype is not None else np.float32
    scale, softcap = _float_attr(node, "scale", 1.0 / float(np.sqrt(head_dim))), _float_attr(node, "softcap")
    tape = ir.tape.Tape()
    group = heads // kv_heads
    q5 = tape.op("Reshape", [q, _const(tape, np.array([0, kv_heads, group, -1, head_dim], np.int64))])
    k5 = tape.op("Unsqueeze", [k, _const(tape, np.array([2], np.int64))])
    v5 = tape.op("Unsqueeze", [v, _const(tape, np.array([2], np.int64))])
    scores = tape.op("MatMul", [q5, tape.op("Transpose", [k5], attributes={"perm": [0, 1, 2, 4, 3]})])
    scores = tape.op("Mul", [scores, _const(tape, np.array(scale, dtype))])
    capped = tape.op("Tanh", [tape.op("Div", [scores, _const(tape, np.array(softcap, dtype))])])
    scores = tape.op("Mul", [capped, _const(tape, np.array(softcap, dtype))])
    mask5 = tape.op("Unsqueeze", [mask, _const(tape, np.array([1], np.int64))])  # [B, 1, 1, S, C]
    # The dtype's lowest finite value, not -inf: a row with nothing visible gives zeros, not NaN.
    scores = tape.op("Where", [mask5, scores, _const(tape, np.array(np.finfo(dtype).min, dtype))])
    probs = tape.op("Softmax", [scores], attributes={"axis": -1})
    out = tape.op("MatMul", [probs, v5])  # [B, Hkv, G, S, D]
    out = tape.op("Reshape", [out, _const(tape, np.array([0, heads, -1, head_dim], np.int64))])
    ir.convenience.replace_nodes_and_values(graph, node, [node], tape.nodes, [node.outputs[0]], [out])
