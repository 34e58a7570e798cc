"""Integer weights carried into MatMulNBits as they are: a pre-quantised checkpoint's (GPTQ, AWQ,
compressed-tensors, AutoRound) or a GGUF's Q4_0 / Q8_0 blocks (kvforge.exporter.quantization.int_weights).

MatMulNBits' layout: B is uint8 [N, blocks, block_size * bits / 8], the values of a block in input order,
two 4-bit values a byte with the first in the low nibble; scales [N, blocks] in the activations' dtype;
zero points uint8, packed the same way ([N, ceil(blocks * bits / 8)]), or absent for the default
2**(bits - 1). A weight whose groups are not consecutive (act-order) reads its activations through a
Gather in the order its blocks follow. The values are computed when the weights file is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import onnx_ir as ir

from kvforge.exporter.graph_edit import PARTS_META
from kvforge.exporter.quantization.int_weights import IntWeight, WeightSpec


class IntWeightSource(Protocol):
    """Where integer weights come from, by the Hugging Face parameter name of the weight ('...q_proj.weight')."""

    kind: str  # what the record calls them: "gptq", "awq", "compressed-tensors", "auto-round", "gguf"
    # Whether --quantize rounds the weights the source has no integers for (a GGUF's other block types), or
    # they stay as the checkpoint has them (a pre-quantised checkpoint's float lm_head and embedding)
    rounds_the_rest: bool

    def spec(self, name: str) -> WeightSpec | None: ...

    def load(self, name: str) -> IntWeight: ...



def source_names(weight: ir.Value) -> list[str]:
    """The Hugging Face parameter names behind a MatMul's constant [K, N]: the parameter itself, or each part
    of a q/k/v or gate/up merge."""
    parts = weight.meta.get(PARTS_META) or [weight.name]
    # (".T": folded from its Transpose; "_transposed": a tied lm_head's embedding, quantize.py)
    return [p.removesuffix(".T").removesuffix("_transposed") for p in parts]


def _known(source: IntWeightSource, name: str) -> str:
    """`name` as the source knows it: the traced graph names the model's parameters under the export
    wrapper's attribute (`model.` + the checkpoint's name)."""
    if source.spec(name) is None and name.startswith("model.") and source.spec(name[6:]) is not None:
        return name[6:]
    return name


def specs_for(weight: ir.Value, source: IntWeightSource | None) -> list[WeightSpec] | None:
    """The specs of every part of `weight`, or None when any part has no integer form (it is rounded)."""
    if source is None:
        return None
    specs = [source.spec(_known(source, name)) for name in source_names(weight)]
    return None if any(s is None for s in specs) else specs  # type: ignore[return-value]


def _alike(specs: Sequence[WeightSpec]) -> bool:
    """Whether the parts can share one MatMulNBits: one width, block size, input order and kind of zero point."""
    first = specs[0]
    return all((s.bits, s.block_size, s.order, s.float_zero_points)
               == (first.bits, first.block_size, first.order, first.float_zero_points) for s in specs)


def pack_values(values: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """uint8 [N, K] values -> MatMulNBits' B [N, K / block_size, block_size * bits / 8]."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // block_size, block_size)
    if bits == 8:
        return np.ascontiguousarray(blocks)
    return (blocks[..., 0::2] | (blocks[..., 1::2] << 4)).astype(np.uint8)


def pack_zero_points(zero_points: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [N, blocks] -> MatMulNBits' zero points (4 bits: two blocks a byte, the first in the low nibble)."""
    if bits == 8:
        return np.ascontiguousarray(zero_points)
    rows, blocks = zero_points.shape
    padded = np.zeros((rows, blocks + blocks % 2), np.uint8)
    padded[:, :blocks] = zero_points
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)


def import_matmul(graph: ir.Graph, node: ir.Node, source: IntWeightSource, specs: Sequence[WeightSpec],
                  accuracy_level: int) -> None:
    """MatMul(x, W) -> MatMulNBits over the parts' integer weights joined along N, bit for bit. Parts of a
    merged q/k/v or gate/up that differ in width or input order (act-order per layer) get one MatMulNBits
    each, their outputs joined."""
    from kvforge.exporter.quantization.rtn import _replace

    names = [_known(source, name) for name in source_names(node.inputs[1])]
    if _alike(specs):
        inputs, attributes = _nbits_inputs(graph, node, source, names, specs, node.inputs[1].name, accuracy_level)
        _replace(graph, node, "MatMulNBits", inputs, attributes, f"_Q{specs[0].bits}")
        return
    tape = ir.tape.Tape()
    outputs = []
    for name, spec in zip(names, specs, strict=True):
        inputs, attributes = _nbits_inputs(graph, node, source, [name], [spec], f"{name}.T", accuracy_level)
        outputs.append(tape.op("MatMulNBits", inputs, attributes=attributes, domain="com.microsoft"))
    joined = tape.op("Concat", outputs, attributes={"axis": -1})
    graph.insert_before(node, tape.nodes)
    from kvforge.exporter.graph_edit import take_over

    take_over(graph, node, joined)


def _nbits_inputs(graph: ir.Graph, node: ir.Node, source: IntWeightSource, names: list[str],
                  specs: Sequence[WeightSpec], weight_name: str, accuracy_level: int) -> tuple[list, dict]:
    """A MatMulNBits' inputs (lazy initializers) and attributes for parts of one width and input order."""
    from kvforge.exporter.quantization.rtn import _initializer, _Parts

    first = specs[0]
    bits, block_size, cols = first.bits, first.block_size, first.shape[1]
    rows = sum(s.shape[0] for s in specs)
    blocks, blob = cols // block_size, block_size * bits // 8
    symmetric = all(s.symmetric for s in specs)
    scale_dtype = node.inputs[0].dtype or ir.DataType.FLOAT

    def compute() -> tuple[np.ndarray, ...]:
        parts = [source.load(name) for name in names]
        packed = np.concatenate([pack_values(p.values, bits, block_size) for p in parts])
        scales = np.concatenate([p.scales for p in parts]).astype(scale_dtype.numpy())
        zeros = np.concatenate([p.zero_point_array() for p in parts])
        # Float zero points (a GGUF Q4_1's) stay floats in the scales' dtype: float_offsets moves them beside the kernel
        zeros = zeros.astype(scales.dtype) if first.float_zero_points else pack_zero_points(zeros, bits)
        return packed, scales, zeros

    parts = _Parts(compute)
    inputs: list[ir.Value | None] = [node.inputs[0]]
    if first.order is not None:
        inputs[0] = _gathered(graph, node, np.asarray(first.order, np.int64), weight_name)
    inputs.append(_initializer(graph, f"{weight_name}_Q{bits}", ir.DataType.UINT8, (rows, blocks, blob), parts, 0))
    inputs.append(_initializer(graph, f"{weight_name}_scales", scale_dtype, (rows, blocks), parts, 1))
    if first.float_zero_points:
        inputs.append(_initializer(graph, f"{weight_name}_zero_points", scale_dtype, (rows, blocks), parts, 2))
    elif not symmetric:
        zero_bytes = (blocks * bits + 7) // 8
        inputs.append(_initializer(graph, f"{weight_name}_zero_points", ir.DataType.UINT8, (rows, zero_bytes), parts, 2))
    attributes = {"K": cols, "N": rows, "bits": bits, "block_size": block_size}
    if accuracy_level:
        attributes["accuracy_level"] = accuracy_level
    return inputs, attributes


def _gathered(graph: ir.Graph, node: ir.Node, order: np.ndarray, name: str) -> ir.Value:
    """x[..., order]: the activations in the order of an act-order weight's blocks."""
    tape = ir.tape.Tape()
    indices = tape.initializer(ir.tensor(order), name=f"{name}_input_order")
    gathered = tape.op("Gather", [node.inputs[0], indices], attributes={"axis": -1})
    for value in tape.initializers:
        graph.register_initializer(value)
    graph.insert_before(node, tape.nodes)
    return gathered
