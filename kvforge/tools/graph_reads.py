"""What one decode step reads of an ONNX graph's initializers (its weights), from the graph's bytes.

A step reads every weight matrix whole (MatMul, MatMulNBits, the lm_head), but a lookup table only at the
rows it looks up: the token embedding (Gather, GatherBlockQuantized) one row per token,
GroupQueryAttention's rotary caches one row per position, an ONNX Runtime MoE / QMoE layer's experts the k
each token is routed to. A tensor that one node looks up and another reads whole (a tied embedding that is
also the lm_head) counts whole, once. A tensor no top-level node reads (one a subgraph takes) counts whole:
an upper bound.

Besides bytes, the logical weight elements a step reads (a 4-bit block's values, not its packed bytes; no
scales or zero points), so that a peer running the same model at another precision (Hugging Face in fp32)
is costed as those elements times its own element size.

The graph is read with kvforge's own protobuf walker (kvforge/core/external_data.py), not `onnx`: the
benchmarks run where only the runtime is installed (a GPU machine with onnxruntime-gpu).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvforge.core.external_data import MalformedGraph, message_fields, read_varint

# onnx.proto's TensorProto.DataType -> bits per element (strings and unknown types: not weights)
_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 14: 64, 15: 128,
         16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}
_MS = "com.microsoft"
# (domain, op) -> the input positions looked up one row per token, and the attribute naming the gathered axis
_ROW_LOOKUPS = {("", "Gather"): ((0,), "axis"), (_MS, "GatherBlockQuantized"): ((0, 2, 3), "gather_axis"),
                (_MS, "GroupQueryAttention"): ((7, 8), None)}
_EXPERTS = {(_MS, "MoE"), (_MS, "QMoE")}  # inputs from 2 on: [experts, ...] stacks, k of them read per token
# (domain, op) -> {position: the attribute giving its packed bits (default 4), or None: no weight elements
# (scales, zero points, group index)}
_PACKED = {(_MS, "MatMulNBits"): {2: None, 3: None, 4: None},
           (_MS, "GatherBlockQuantized"): {0: "bits", 2: None, 3: None},
           (_MS, "QMoE"): {2: "expert_weight_bits", 5: "expert_weight_bits", 8: "expert_weight_bits",
                           3: None, 6: None, 9: None, 11: None, 12: None, 13: None}}


@dataclass(frozen=True)
class Initializer:
    name: str
    dims: tuple[int, ...]
    data_type: int

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return -(-self.elements * _BITS.get(self.data_type, 0) // 8)


@dataclass
class Node:
    op_type: str = ""
    domain: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    ints: dict[str, int] = field(default_factory=dict)  # its integer attributes


def _text(data: bytes, begin: int, after: int) -> str:
    return data[begin:after].decode("utf-8", errors="replace")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value  # protobuf's int64 in two's complement


def _initializer(data: bytes, start: int, end: int) -> Initializer:
    dims: list[int] = []
    name, data_type = "", 0
    for number, wire, begin, after in message_fields(data, start, end):
        if number == 1 and wire == 0:  # dims, one varint each
            dims.append(read_varint(data, begin, after)[0])
        elif number == 1 and wire == 2:  # dims, packed
            pos = begin
            while pos < after:
                value, pos = read_varint(data, pos, after)
                dims.append(value)
        elif number == 2 and wire == 0:
            data_type = read_varint(data, begin, after)[0]
        elif number == 8 and wire == 2:
            name = _text(data, begin, after)
    return Initializer(name, tuple(dims), data_type)


def _node(data: bytes, start: int, end: int) -> Node:
    node = Node()
    for number, wire, begin, after in message_fields(data, start, end):
        if wire != 2:
            continue
        if number in (1, 2):
            (node.inputs if number == 1 else node.outputs).append(_text(data, begin, after))
        elif number == 4:
            node.op_type = _text(data, begin, after)
        elif number == 7:
            node.domain = _text(data, begin, after)
        elif number == 5:  # an attribute: name = 1, i = 3
            name, value = "", None
            for a_number, a_wire, a_begin, a_after in message_fields(data, begin, after):
                if a_number == 1 and a_wire == 2:
                    name = _text(data, a_begin, a_after)
                elif a_number == 3 and a_wire == 0:
                    value = _signed(read_varint(data, a_begin, a_after)[0])
            if value is not None:
                node.ints[name] = value
    if node.domain == "ai.onnx":
        node.domain = ""
    return node


def read_graph(data: bytes) -> tuple[dict[str, Initializer], list[Node]]:
    """The top-level initializers and nodes of the ONNX model `data` (subgraphs are not read).
    MalformedGraph if the bytes are not a model."""
    graph = next(((b, a) for number, wire, b, a in message_fields(data, 0, len(data)) if number == 7 and wire == 2),
                 None)
    if graph is None:
        raise MalformedGraph("no graph in the model")
    initializers: dict[str, Initializer] = {}
    nodes: list[Node] = []
    for number, wire, begin, after in message_fields(data, *graph):
        if number == 1 and wire == 2:
            nodes.append(_node(data, begin, after))
        elif number == 5 and wire == 2:
            tensor = _initializer(data, begin, after)
            initializers[tensor.name] = tensor
    return initializers, nodes


def _elements(node: Node, position: int, tensor: Initializer) -> float:
    """The logical weight elements of `tensor` as `node` takes it at input `position`."""
    key = (node.domain, node.op_type)
    if key == (_MS, "MatMulNBits") and position == 1 and {"K", "N"} <= set(node.ints):
        return node.ints["K"] * node.ints["N"]
    packed = _PACKED.get(key, {})
    if position not in packed:
        return tensor.elements
    bits_attribute = packed[position]
    if bits_attribute is None:
        return 0
    # uint8 / int8 storage packs 8 / bits values per byte; an int4 tensor type is already logical
    return tensor.elements * 8 / node.ints.get(bits_attribute, 4) if tensor.data_type in (2, 3) else tensor.elements


def _share(node: Node, position: int, tensor: Initializer, batch: int) -> float:
    """The part of `tensor` that `node` reads in a decode step of `batch` rows (one new token each)."""
    key = (node.domain, node.op_type)
    rows = tensor.dims[0] if tensor.dims else 0
    if key in _ROW_LOOKUPS and rows:
        positions, axis = _ROW_LOOKUPS[key]
        if position in positions and (axis is None or node.ints.get(axis, 0) == 0):
            return min(1.0, batch / rows)
    if key in _EXPERTS and position >= 2 and rows:
        return min(1.0, batch * node.ints.get("k", 1) / rows)  # at most every expert
    return 1.0


def _reads(name: str, tensor: Initializer, consumers: dict[str, list[tuple[Node, int]]], batch: int,
           depth: int = 0) -> tuple[float, float]:
    """(bytes, elements) of `tensor` read through value `name`: the largest read of any consumer, through a
    Reshape to what reads its view (how a quantised tied embedding is looked up in the lm_head's blocks)."""
    best = (0.0, 0.0)
    for node, position in consumers.get(name, ()):
        if node.op_type == "Reshape" and node.domain == "" and position == 0 and node.outputs and depth < 8:
            read = _reads(node.outputs[0], tensor, consumers, batch, depth + 1)
        else:
            share = _share(node, position, tensor, batch)
            read = (tensor.nbytes * share, _elements(node, position, tensor) * share)
        best = max(best, read)
    return best


def step_weight_reads(data: bytes, batch: int) -> dict[str, int]:
    """What a decode step of `batch` rows reads of the initializers of the ONNX model `data`: `weights_bytes`,
    `weight_elements` (logical, see the module docstring), and `stored_bytes` (every initializer, whole)."""
    initializers, nodes = read_graph(data)
    consumers: dict[str, list[tuple[Node, int]]] = {}
    for node in nodes:
        for position, name in enumerate(node.inputs):
            if name:
                consumers.setdefault(name, []).append((node, position))
    read_bytes = read_elements = 0.0
    for name, tensor in initializers.items():
        if name in consumers:
            step_bytes, elements = _reads(name, tensor, consumers, batch)
        else:  # taken by a subgraph (or by nothing): counted whole
            step_bytes, elements = tensor.nbytes, tensor.elements
        read_bytes += step_bytes
        read_elements += elements
    return {"weights_bytes": round(read_bytes), "weight_elements": round(read_elements),
            "stored_bytes": sum(t.nbytes for t in initializers.values())}
