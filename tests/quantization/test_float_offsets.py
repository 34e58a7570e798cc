"""Float zero points moved beside ONNX Runtime's integer kernel (exporter/quantization/float_offsets.py): the same products
as MatMulNBits with its float zero points and as the dense weight they stand for."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.exporter.quantization.float_offsets import move_float_zero_points

K, N, BLOCK = 96, 40, 32


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (N, K), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, K // BLOCK)).astype(np.float32)
    zeros = rng.uniform(0, 15, (N, K // BLOCK)).astype(np.float32)  # float: HQQ's, or a Q4_1 block's -min/d
    return q, scales, zeros


def _model(rank: int, extra_inputs: tuple[str, ...] = ()) -> onnx.ModelProto:
    q, scales, zeros = _weights()
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(N, K // BLOCK, BLOCK // 2)
    inits = [numpy_helper.from_array(packed, "w_Q4"), numpy_helper.from_array(scales.reshape(-1), "w_scales"),
             numpy_helper.from_array(zeros.reshape(-1), "w_zero_points")]
    shape = ["b", "s", K][-rank:] if rank > 1 else [K]
    node = helper.make_node("MatMulNBits", ["x", "w_Q4", "w_scales", "w_zero_points", *extra_inputs], ["y"],
                            domain="com.microsoft", K=K, N=N, bits=4, block_size=BLOCK, accuracy_level=1)
    if extra_inputs:
        inits.append(numpy_helper.from_array(np.arange(K, dtype=np.int32) // BLOCK, extra_inputs[0]))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("rank", [2, 3])
def test_the_moved_product_equals_float_zero_points_and_the_dense_weight(rank: int) -> None:
    proto = _model(rank)
    model = ir.from_proto(proto)
    assert move_float_zero_points(model) == 1
    moved = ir.to_proto(model)
    ops = [n.op_type for n in moved.graph.node]
    assert sorted(ops) == sorted(["Reshape", "ReduceSum", "MatMulNBits", "MatMul", "Add"])
    nbits = next(n for n in moved.graph.node if n.op_type == "MatMulNBits")
    assert list(nbits.input) == ["x", "w_Q4", "w_scales"]  # the integer kernel's default zero point, 8
    assert "w_zero_points" not in {t.name for t in moved.graph.initializer}

    x = np.random.default_rng(1).standard_normal((2, 3, K) if rank == 3 else (5, K)).astype(np.float32)
    q, scales, zeros = _weights()
    dense = ((q.reshape(N, -1, BLOCK) - zeros[..., None]) * scales[..., None]).reshape(N, K)
    expected = x @ dense.T
    slow, fast = _run(proto, x), _run(moved, x)
    np.testing.assert_allclose(slow, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fast, expected, rtol=1e-4, atol=1e-4)
    # The moved offsets are not a small correction: without them the product is far off.
    assert np.abs(fast - x @ (((q.reshape(N, -1, BLOCK) - 8.0) * scales[..., None]).reshape(N, K)).T).max() > 0.1


def test_a_node_with_a_group_index_keeps_its_float_zero_points() -> None:
    model = ir.from_proto(_model(3, extra_inputs=("g_idx",)))
    assert move_float_zero_points(model) == 0
    assert [n.op_type for n in model.graph] == ["MatMulNBits"]


def test_integer_zero_points_are_left_alone() -> None:
    proto = _model(3)
    zero = next(t for t in proto.graph.initializer if t.name == "w_zero_points")
    zero.CopyFrom(numpy_helper.from_array(np.full((N, 2), 0x88, np.uint8), "w_zero_points"))
    model = ir.from_proto(proto)
    assert move_float_zero_points(model) == 0
    assert len(list(model.graph)) == 1
