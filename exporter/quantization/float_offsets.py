"""Float zero points on ONNX Runtime's fast integer kernel.

MatMulNBits takes zero points as integers (uint8) or as floats. Its CPU kernels with int8 activations
(`accuracy_level` 4, the fast path) pack only integer ones: with float zero points every product
dequantises the whole weight first, 14x slower on SmolLM2-135M. Yet float zero points are where HQQ's
accuracy lives, and what a GGUF Q4_1 block is (`d * q + m`: a block minimum that is no whole number of
steps).

A block's value `s * (q - z)` with a float `z` is `s * (q - 8) + s * (8 - z)`: the symmetric integer
kernel on the same 4-bit values (MatMulNBits' default zero point, 8), plus a constant per block and
output column. That constant's share of the product is the sum of the block's activations times it, so
each such node becomes

    MatMulNBits(x, q, s)  +  ReduceSum(x in blocks) @ C,    C[block, n] = s[n, block] * (8 - z[n, block])

exact in real arithmetic (the offset is computed in float from the unquantised activations). It costs
C's bytes (one float per block and column: a fifth more than the 4-bit blocks and scales) and three small
nodes per product (docs/quantisation.md measures both).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401  (ir.passes.common below)

from kvforge.exporter.graph_edit import take_over

ZERO_POINT = 3  # MatMulNBits' input index of its zero points


def float_zero_points(node: ir.Node) -> ir.Value | None:
    """The node's zero points when they are a float constant (None otherwise)."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.inputs) <= ZERO_POINT:
        return None
    zero = node.inputs[ZERO_POINT]
    if zero is None or zero.const_value is None or zero.const_value.dtype == ir.DataType.UINT8:
        return None
    return zero


def _offsets(node: ir.Node, zero: ir.Value) -> ir.LazyTensor | None:
    """C [blocks, N] in the scales' dtype, computed when it is written (the scales and zero points may be lazy
    themselves: an imported checkpoint's), or None where the node's layout is not the plain one this handles."""
    attrs = node.attributes
    rows, cols = attrs.get_int("N"), attrs.get_int("K")
    bits, block = attrs.get_int("bits"), attrs.get_int("block_size")
    scales = node.inputs[2].const_value if node.inputs[2] is not None else None
    if scales is None or cols % block or any(v is not None for v in node.inputs[ZERO_POINT + 1:ZERO_POINT + 2]):
        return None  # a padded last block, runtime scales or a group index (act-order): left as it is
    blocks, zeros = cols // block, zero.const_value

    def make() -> ir.Tensor:
        scale = scales.numpy().astype(np.float64).reshape(rows, blocks)
        offset = scale * ((1 << (bits - 1)) - zeros.numpy().astype(np.float64).reshape(rows, blocks))
        return ir.Tensor(np.ascontiguousarray(offset.T).astype(scales.dtype.numpy()))

    return ir.LazyTensor(make, dtype=scales.dtype, shape=ir.Shape([blocks, rows]),
                         name=f"{node.inputs[1].name}_block_offsets")


def move_float_zero_points(model: ir.Model) -> int:
    """Every MatMulNBits with float zero points -> the integer kernel plus its per-block offsets (module
    docstring). Returns how many were moved; a node whose layout this does not handle keeps its float zero
    points (correct, on the slow path)."""
    graph, moved = model.graph, 0
    for node in list(graph):
        zero = float_zero_points(node)
        if zero is None:
            continue
        offsets = _offsets(node, zero)
        x = node.inputs[0]
        rank = len(x.shape) if x.shape is not None else None
        if offsets is None or rank is None:
            continue
        blocks, block = int(offsets.shape[0]), node.attributes.get_int("block_size")
        name = node.inputs[1].name
        tape = ir.tape.Tape()
        # [..., K] -> [..., blocks, block]: 0 keeps a leading dimension as it is (batch, sequence)
        shape = tape.initializer(ir.tensor(np.array([0] * (rank - 1) + [blocks, block], np.int64)),
                                 name=f"{name}_block_shape")
        axis = tape.initializer(ir.tensor(np.array([-1], np.int64)), name=f"{name}_block_axis")
        table = tape.initializer(offsets, name=f"{name}_block_offsets")
        sums = tape.op("ReduceSum", [tape.op("Reshape", [x, shape]), axis], attributes={"keepdims": 0})
        inputs = list(node.inputs)
        inputs[ZERO_POINT] = None  # the default zero point, 2**(bits - 1)
        while inputs and inputs[-1] is None:
            inputs.pop()
        product = tape.op("MatMulNBits", inputs, attributes={k: a.value for k, a in node.attributes.items()},
                          domain="com.microsoft")
        total = tape.op("Add", [product, tape.op("MatMul", [sums, table])])
        for value in tape.initializers:
            graph.register_initializer(value)
        graph.insert_before(node, tape.nodes)
        take_over(graph, node, total)
        moved += 1
    if moved:
        ir.passes.common.RemoveUnusedNodesPass()(model)  # and the float zero points
    return moved
