"""`--draft-lm-head-bits`: draft.onnx's lm_head (the MatMul making the head's vocabulary logits) stored as a
MatMulNBits block-quantised matrix (exporter/quantization/rtn.py, as --quantize rounds the target's).

Why: at a Llama-3.2-1B shape an MTP head's fp32 lm_head is ~79% of what the head reads per drafted token
(benchmarks/results/mtp_head_cost_1b.json). A draft need not be exact: verification keeps greedy output, and the
sampled distribution, whatever the draft proposes, so slightly different draft logits cost only acceptance.
ONNX Runtime's CPU and CUDA MatMulNBits only: the ort target.
"""

from __future__ import annotations

from typing import Any

from kvforge.core.errors import ExportError

BLOCK_SIZE = 32  # as exporter/quantization/plan.py's default block size
ACCURACY_LEVEL = 4  # int8 activations on the CPU, as --quantize's default


def lm_head_node(model: Any) -> Any:
    """The MatMul producing the graph's `logits` (through any Cast: an fp16 head's `.float()`), its weight a
    constant [H, V] whose V is the logits' width."""
    from kvforge.core.contract import LOGITS

    graph = model.graph
    value = next((v for v in graph.outputs if v.name == LOGITS), None)
    node = value.producer() if value is not None else None
    while node is not None and node.op_type == "Cast" and node.domain == "":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    weight = node.inputs[1] if node is not None and node.op_type == "MatMul" and len(node.inputs) == 2 else None
    if weight is None or weight.const_value is None or len(weight.const_value.shape) != 2:
        raise ExportError("draft.onnx's logits are not made by a MatMul with a constant weight; export it without "
                          "--draft-lm-head-bits")
    return node


def quantize_lm_head(model: Any, bits: int | None, record: dict[str, Any]) -> None:
    """Replace draft.onnx's lm_head MatMul by MatMulNBits (`bits`, blocks of BLOCK_SIZE, symmetric), its blocks
    computed as the weights file is written; `record` (the manifest's draft record) says so. None: left float."""
    from kvforge.exporter.quantization.rtn import quantize_matmul

    if bits is None:
        return
    node = lm_head_node(model)
    weight = node.inputs[1]
    if not quantize_matmul(model.graph, node, bits, BLOCK_SIZE, ACCURACY_LEVEL):
        raise ExportError("draft.onnx's lm_head weight is not a matrix; export it without --draft-lm-head-bits")
    if not weight.uses() and weight.name in model.graph.initializers:  # the float matrix is not written too
        del model.graph.initializers[weight.name]
    record["lm_head_bits"] = bits
    record["lm_head_block_size"] = BLOCK_SIZE
