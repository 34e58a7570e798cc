"""int4 / int8 weights rounded tensor by tensor (RTN), as lazy tensors: the export never holds the model.

The values come from ONNX Runtime's own block quantiser, called on one weight at a time
(`DefaultWeightOnlyQuantizer.qbits_block_quant` for MatMul weights, `quantize_ndarray` for an embedding
table), the same calls its whole-model MatMulNBitsQuantizer makes: the graph is the one it writes
(MatMulNBits, symmetric blocks, GatherBlockQuantized for the embedding), bit for bit. Each quantised
weight is computed when the weights file is written, from the weight's own dtype (an fp16 or bf16
checkpoint is widened one tensor at a time), and dropped once written.

The activations keep the export's dtype: fp32 for ONNX Runtime's CPU, fp16 or bf16 for its CUDA
MatMulNBits, whose scales then take that dtype too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.exporter.graph_edit import take_over
from kvforge.exporter.lazy_weights import contiguous, release_pages, stored_array

# Elements of a weight widened to fp32 at a time (64 MB).
CHUNK_ELEMENTS = 1 << 24


def quantizer_class() -> type:
    """ONNX Runtime's MatMulNBitsQuantizer, imported without its side effect: the module calls
    `logging.basicConfig(level=INFO)` when imported, which would print every library's INFO records for the
    rest of the process (onnx_ir's pass logging, each with a full stack: ~150 stderr lines per int4 export).
    The root logger is put back as it was; WARNING and above still reach stderr through Python's default."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for handler in root.handlers[:]:
        if handler not in handlers:  # only what the import added: an application's own setup stays
            root.removeHandler(handler)
    root.setLevel(level)
    return MatMulNBitsQuantizer


def _quantizer(bits: int, block_size: int, accuracy_level: int) -> Any:
    quantizer_class()  # the module imported without its logging side effect
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level, bits=bits))


class _Parts:
    """The outputs of one quantisation (blocks, scales), computed on the first request. A large part is
    dropped once taken, so the writer holds one weight's result at a time; small ones stay (they are
    inlined in both graphs, so read once per graph). A dropped part asked for again is recomputed."""

    KEEP_BYTES = 1 << 20

    def __init__(self, compute: Callable[[], tuple[Any, ...]]) -> None:
        self.compute, self.parts = compute, None

    def take(self, index: int) -> Any:
        if self.parts is None or self.parts[index] is None:
            self.parts = list(self.compute())
        part = self.parts[index]
        if part.nbytes > self.KEEP_BYTES:
            self.parts[index] = None
        return part


def _widened(array: np.ndarray) -> np.ndarray:
    return contiguous(array, np.dtype(np.float32))  # the kernel reads a C-order buffer


def _activation_numpy(dtype: ir.DataType) -> Any:
    return dtype.numpy()


def quantize_matmul(graph: ir.Graph, node: ir.Node, bits: int, block_size: int, accuracy_level: int) -> bool:
    """MatMul(x, W) with W a constant [K, N] -> com.microsoft.MatMulNBits, W's blocks and scales lazy.
    Returns False (and leaves the node) for a weight that is not 2-D."""
    weight = node.inputs[1]
    tensor = weight.const_value
    if tensor is None or len(tensor.shape) != 2:
        return False
    rows, cols = (int(d) for d in tensor.shape)
    k_blocks = (rows + block_size - 1) // block_size
    blob = (block_size * bits + 7) // 8
    scale_dtype = node.inputs[0].dtype or tensor.dtype  # the activations' dtype
    quantizer = _quantizer(bits, block_size, accuracy_level)

    def compute() -> tuple[np.ndarray, np.ndarray]:
        # Column by column: each column's blocks are its own, so slices of columns give the same bits as the
        # whole, and only a slice is ever widened to fp32 (an 8B lm_head would take 2.1 GB at once).
        # Each slice is written into the result (no list of parts joined at the end: a second whole copy).
        weights, step = stored_array(tensor), max(1, CHUNK_ELEMENTS // rows)
        packed = np.empty((cols, k_blocks, blob), np.uint8)
        scales = np.empty((cols, k_blocks), _activation_numpy(scale_dtype))
        for start in range(0, cols, step):
            with np.errstate(divide="ignore", invalid="ignore"):
                part, part_scales, _ = quantizer.qbits_block_quant(_widened(weights[:, start:start + step]))
            packed[start:start + step] = part.reshape(-1, k_blocks, blob)
            scales[start:start + step] = part_scales.reshape(-1, k_blocks)
            release_pages(weights[:, start:start + step])
        return packed, scales

    parts = _Parts(compute)
    blocks = _initializer(graph, f"{weight.name}_Q{bits}", ir.DataType.UINT8, (cols, k_blocks, blob), parts, 0)
    scales = _initializer(graph, f"{weight.name}_scales", scale_dtype, (cols, k_blocks), parts, 1)
    attributes = {"K": rows, "N": cols, "bits": bits, "block_size": block_size}
    if accuracy_level:
        attributes["accuracy_level"] = accuracy_level
    _replace(graph, node, "MatMulNBits", [node.inputs[0], blocks, scales], attributes, f"_Q{bits}")
    return True


def quantize_lookup(graph: ir.Graph, node: ir.Node, block_size: int) -> bool:
    """Gather(table, ids) with a constant table -> com.microsoft.GatherBlockQuantized, int4 blocks along
    the hidden axis (ONNX Runtime's quantize_gather). False for a table that is not 2-D."""
    table = node.inputs[0]
    tensor = table.const_value
    if tensor is None or len(tensor.shape) != 2:
        return False
    shape = tuple(int(d) for d in tensor.shape)
    scale_dtype = tensor.dtype
    quantizer = _quantizer(4, block_size, 0)
    k_blocks = (shape[1] + block_size - 1) // block_size

    def compute() -> tuple[Any, np.ndarray]:
        # Row by row (an even number of values a slice, so the packed nibbles of slices join byte for byte).
        table, step = stored_array(tensor), max(2, CHUNK_ELEMENTS // shape[1] // 2 * 2)
        values = np.empty((shape[0] * shape[1] + 1) // 2, np.uint8)
        scales = np.empty((shape[0], k_blocks), _activation_numpy(scale_dtype))
        for start in range(0, shape[0], step):
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero block's scale: np.where discards it
                part, part_scales, _ = quantizer.quantize_ndarray(_widened(table[start:start + step]), 1, block_size, True)
            offset = start * shape[1] // 2
            values[offset:offset + part.size] = part.reshape(-1)
            scales[start:start + step] = part_scales.reshape(-1, k_blocks)
            release_pages(table[start:start + step])
        return ir.PackedTensor(values, ir.DataType.INT4, shape=shape), scales

    parts = _Parts(compute)
    values = _initializer(graph, f"{table.name}_Q4", ir.DataType.INT4, shape, parts, 0)
    scales = _initializer(graph, f"{table.name}_scales", scale_dtype, (shape[0], k_blocks), parts, 1)
    attributes = {"gather_axis": node.attributes.get_int("axis", 0), "quantize_axis": 1, "block_size": block_size}
    _replace(graph, node, "GatherBlockQuantized", [values, node.inputs[1], scales], attributes, "_Q4")
    return True


def _initializer(graph: ir.Graph, name: str, dtype: ir.DataType, shape: tuple[int, ...], parts: _Parts,
                 index: int) -> ir.Value:
    def make() -> ir.TensorProtocol:
        part = parts.take(index)
        return part if isinstance(part, ir.PackedTensor) else ir.Tensor(np.ascontiguousarray(part), dtype=dtype)

    tensor = ir.LazyTensor(make, dtype=dtype, shape=ir.Shape(list(shape)), name=name)
    value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _replace(graph: ir.Graph, node: ir.Node, op_type: str, inputs: list[ir.Value], attributes: dict[str, Any],
             suffix: str) -> None:
    tape = ir.tape.Tape()
    result = tape.op(op_type, inputs, attributes=attributes, domain="com.microsoft")
    if node.name:
        tape.nodes[-1].name = f"{node.name}{suffix}"
    graph.insert_before(node, tape.nodes)
    take_over(graph, node, result)
