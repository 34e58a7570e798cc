"""The external-data files an ONNX graph refers to, read from its bytes without `onnx`.

The runtime hands ONNX Runtime graph bytes checked against the manifest's sha256, but a graph's
large tensors live in other files, named by each TensorProto's `external_data` entry with key
"location". A graph that names a file the manifest does not list would load weights that nothing
hashed, so the loader checks every such name (kvforge/core/manifest.py, `read_graph`).

The runtime must stay free of `onnx`, and a byte search for "location" could be fooled (or miss a
name split oddly), so this walks the protobuf wire format itself: it descends only into the fields
that can hold a TensorProto (the graph, its nodes' attributes, subgraphs, functions, sparse
tensors, training graphs) and skips every other field by its length, as protobuf does with fields
it does not know. Field numbers are those of onnx/onnx.proto (IR version 10).
"""

from __future__ import annotations

# Field numbers of onnx.proto: which length-delimited fields of each message lead to tensors.
_MODEL = {7: "graph", 20: "training", 25: "function"}  # ModelProto.graph / training_info / functions
_TRAINING = {1: "graph", 2: "graph"}  # TrainingInfoProto.initialization / algorithm
_FUNCTION = {7: "node", 11: "attribute"}  # FunctionProto.node / attribute_proto
_GRAPH = {1: "node", 5: "tensor", 15: "sparse"}  # GraphProto.node / initializer / sparse_initializer
_NODE = {5: "attribute"}  # NodeProto.attribute
# AttributeProto.t / g / tensors / graphs / sparse_tensor / sparse_tensors
_ATTRIBUTE = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}
_SPARSE = {1: "tensor", 2: "tensor"}  # SparseTensorProto.values / indices
_TENSOR_EXTERNAL_DATA = 13  # TensorProto.external_data: repeated StringStringEntryProto {key = 1, value = 2}
_MESSAGES = {"model": _MODEL, "training": _TRAINING, "function": _FUNCTION, "graph": _GRAPH, "node": _NODE,
             "attribute": _ATTRIBUTE, "sparse": _SPARSE}
# protobuf's own default nesting limit; deeper input is refused by ONNX Runtime's parser too.
MAX_DEPTH = 100


class MalformedGraph(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise MalformedGraph(f"truncated or overlong varint at byte {pos}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes, start: int, end: int):
    """(field number, wire type, payload start, payload end) of each field of the message in
    data[start:end]; varints and fixed-size values have their payload bounds too."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise MalformedGraph(f"field number 0 at byte {pos}")
        if wire == 0:
            _, after = _varint(data, pos, end)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos, end)
            after = pos + length
        elif wire == 5:
            after = pos + 4
        elif wire == 3:  # a (deprecated) group: skip to its matching end-group tag
            after = _skip_group(data, pos, end, number)
        else:
            raise MalformedGraph(f"wire type {wire} at byte {pos}")
        if after > end:
            raise MalformedGraph(f"field {number} runs past the end of its message (byte {pos})")
        yield number, wire, pos, after
        pos = after


def _skip_group(data: bytes, pos: int, end: int, number: int) -> int:
    depth = 1
    while depth:
        key, pos = _varint(data, pos, end)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(data, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _varint(data, pos, end)
            pos += length
        elif wire == 5:
            pos += 4
        elif wire == 3:
            depth += 1
        elif wire == 4:
            depth -= 1
        else:
            raise MalformedGraph(f"wire type {wire} at byte {pos}")
        if pos > end:
            raise MalformedGraph(f"group {number} runs past the end of its message")
    return pos


def _entry(data: bytes, start: int, end: int) -> tuple[bytes | None, bytes | None]:
    key = value = None
    for number, wire, begin, after in _fields(data, start, end):
        if wire == 2 and number == 1:
            key = data[begin:after]
        elif wire == 2 and number == 2:
            value = data[begin:after]
    return key, value


def external_data_locations(data: bytes) -> set[str]:
    """Every `location` named by an external_data entry of any tensor in the ONNX model `data`
    (initializers, node attributes, subgraphs, functions, sparse tensors, training graphs).
    MalformedGraph if the bytes are not a well-formed protobuf message."""
    locations: set[str] = set()
    stack: list[tuple[str, int, int, int]] = [("model", 0, len(data), 0)]  # (message kind, start, end, depth)
    while stack:
        kind, start, end, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise MalformedGraph(f"messages nested deeper than {MAX_DEPTH}")
        for number, wire, begin, after in _fields(data, start, end):
            if wire != 2:  # a field of an unexpected wire type is an unknown field to protobuf: skipped
                continue
            if kind == "tensor":
                if number == _TENSOR_EXTERNAL_DATA:
                    key, value = _entry(data, begin, after)
                    if key == b"location" and value is not None:
                        try:
                            locations.add(value.decode("utf-8"))
                        except UnicodeDecodeError as err:
                            raise MalformedGraph(f"an external data location is not UTF-8: {value!r}") from err
                continue
            child = _MESSAGES[kind].get(number)
            if child is not None:
                stack.append((child, begin, after, depth + 1))
    return locations


# The same walker, for readers of other fields (kvforge/tools/graph_reads.py: initializers and nodes).
message_fields = _fields
read_varint = _varint
