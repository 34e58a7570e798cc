"""Weight-only int4 / int8 quantisation with ONNX Runtime's own MatMulNBits quantiser.

Every MatMul with a constant weight becomes com.microsoft.MatMulNBits (block-wise, symmetric), the
lm_head included; the token embedding becomes com.microsoft.GatherBlockQuantized, so a tied embedding
is not kept in fp32 either. Nothing here computes quantised values itself: that is
`onnxruntime.quantization.matmul_nbits_quantizer`. kvforge only prepares the graph (a weight reached
through a Transpose is materialised, so the quantiser sees a constant) and records what was done.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.errors import ExportError, InputError

BITS = {"int4": 4, "int8": 8}
BLOCK_SIZES = (16, 32, 64, 128)
# ONNX Runtime's MatMulNBits accuracy_level 4: int8 activations in the dot products (its fastest CPU path).
DEFAULT_ACCURACY_LEVEL = 4


def check_options(quantize: str | None, block_size: int, dtype: str) -> None:
    if quantize is None:
        return
    if quantize not in BITS:
        raise InputError(f"--quantize takes {', '.join(BITS)}, not {quantize!r}")
    if block_size not in BLOCK_SIZES:
        raise InputError(f"--block-size takes {', '.join(map(str, BLOCK_SIZES))}, not {block_size}")
    if dtype != "fp32":
        raise InputError(f"--quantize works from fp32 weights (activations stay fp32); drop --dtype {dtype}")


def _materialise_transposed_weights(model: ir.Model) -> int:
    """MatMul(x, Transpose(W)) with W constant (a tied lm_head) -> MatMul(x, W^T as a constant)."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "MatMul" or node.domain != "":
            continue
        transpose = node.inputs[1].producer() if node.inputs[1] is not None else None
        if transpose is None or transpose.op_type != "Transpose":
            continue
        source = transpose.inputs[0]
        if source is None or source.const_value is None:
            continue
        array = source.const_value.numpy()
        perm = transpose.attributes.get("perm")
        transposed = np.ascontiguousarray(array.transpose(list(perm.value)) if perm is not None else array.T)
        name = f"{source.name}_transposed"
        value = ir.Value(name=name, shape=ir.Shape(list(transposed.shape)), type=source.type,
                         const_value=ir.tensor(transposed, name=name))
        model.graph.register_initializer(value)
        node.replace_input_with(1, value)
        count += 1
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return count


def quantize_model(model: ir.Model, quantize: str, block_size: int,
                   accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> tuple[ir.Model, dict[str, Any]]:
    """The quantised model (weights in memory) and a record of what was quantised."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    _materialise_transposed_weights(model)
    proto = ir.to_proto(model)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    try:
        quantizer = MatMulNBitsQuantizer(
            proto, bits=BITS[quantize], block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
            op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)),
        )
        quantizer.process()
    except Exception as err:  # the quantiser raises plain exceptions for shapes it cannot handle
        raise ExportError(f"ONNX Runtime's {quantize} quantiser failed: {type(err).__name__}: {err}") from err
    quantized = ir.from_proto(quantizer.model.model)
    ops = Counter(node.op_type for node in quantized.graph)
    left = ops.get("MatMul", 0)
    record = {
        "method": "onnxruntime MatMulNBitsQuantizer (block-wise, symmetric)",
        "bits": BITS[quantize], "block_size": block_size, "accuracy_level": accuracy_level,
        "matmuls_quantized": ops.get("MatMulNBits", 0), "matmuls_left_fp32": left,
        "embedding_quantized": ops.get("GatherBlockQuantized", 0) > 0,
    }
    return quantized, record
