"""The experts' int4 for ONNX Runtime's QMoE (`--quantize int4` on `ort`, exporter/targets/moe_ort.py): each
expert's weights block-wise symmetric by ONNX Runtime's own MatMulNBits quantiser, once per export."""

from __future__ import annotations

import weakref

import numpy as np
import onnx_ir as ir

# Measured with onnxruntime 1.32 (tests/families/test_moe_node.py): its CPU QMoE computes 4-bit block-wise experts
# exactly as dequantised, but 8-bit block-wise ones 0.25 off at outputs of ~20; 8-bit per-row ones agree,
# and ONNX Runtime's quantiser makes those only for input sizes of at most 256.
INT8_EXPERTS = ("the experts stay fp32 with --quantize int8: ONNX Runtime's CPU QMoE disagrees with its own 8-bit "
                "block-wise weights")


def quantize_experts(weights: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, out, in] float -> (packed uint8 [E, out, in * bits / 8], scales [E, out, in / block_size]):
    block-wise symmetric, each expert by ONNX Runtime's own MatMulNBits quantiser (whose packed
    [out, blocks, block bytes] layout is QMoE's [out, in * bits / 8] when `in` is a multiple of the block)."""
    from onnxruntime.capi import _pybind_state

    quantize = {4: _pybind_state.quantize_matmul_4bits, 8: _pybind_state.quantize_matmul_8bits}[bits]
    experts, rows, cols = weights.shape
    blocks = cols // block_size
    packed = np.zeros((experts, rows, blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros((experts, rows * blocks), np.float32)
    zero_points = np.zeros(rows * blocks, np.uint8)  # unused: symmetric
    for expert in range(experts):
        # The quantiser takes a MatMul's B, [in, out].
        quantize(packed[expert], np.ascontiguousarray(weights[expert].T, np.float32), scales[expert], zero_points,
                 block_size, rows, cols, True)
    return packed.reshape(experts, rows, -1), scales.reshape(experts, rows, blocks)


# The prefill and decode graphs share their weight tensors (derive_decode_graph clones the graph, not the
# weights), so an experts tensor is quantised once per export rather than once per graph.
_QUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantized_initializer(graph: ir.Graph, value: ir.Value, bits: int, block_size: int) -> tuple[ir.Value, ir.Value]:
    """The initializers `{name}_q{bits}` and `{name}_scales{bits}` of an experts weight constant (QMoE's fc1 / fc2
    and their scales), added to `graph` once."""
    done = _QUANTIZED.setdefault(value.const_value, {})
    if (bits, block_size) not in done:
        done[bits, block_size] = quantize_experts(value.const_value.numpy(), bits, block_size)
    packed, scales = done[bits, block_size]
    made = []
    for suffix, array in (("q", packed), ("scales", scales)):
        name = f"{value.name}_{suffix}{bits}"
        if name not in graph.initializers:
            graph.register_initializer(ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(
                ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name)))
        made.append(graph.initializers[name])
    return made[0], made[1]
