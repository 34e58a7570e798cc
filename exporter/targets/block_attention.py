"""The `ort` target's form of a fused attention node with image blocks (`block_ids`, exporter/image_blocks.py).

com.microsoft.GroupQueryAttention always applies its own causal mask; its attention_bias is added to the scores, so
it can block a position but never open a later one, which an image token must see within its block. Such nodes (the
prefill graph of a family with image blocks; its decode graph has none) take the `onnx` target's form instead:
TensorScatter into the cache in place and ONNX Attention (opset 24, which ONNX Runtime runs) with a boolean mask of
causal-or-same-block, bounded by the sliding window, over the positions written so far (not the whole capacity).
Measured on CPU (one thread, a 4-layer 512-wide Gemma 3, the same weights exported --text-only for GQA's causal
path): prefill 1.03x GQA's time at 512 tokens, 1.14x at 1024, 1.29x at 2048 (a full S x T score matrix against
GQA's causal kernel); decode is GQA's, unchanged."""

from __future__ import annotations

import onnx_ir as ir

from kvforge.core.errors import ExportError
from kvforge.exporter.image_blocks import block_ids_input


def lower_image_blocks(graph: ir.Graph, canonical: list[ir.Node], kv_scales: object = None) -> list[ir.Node]:
    """Lower the nodes with image blocks as the `onnx` target does; the others, returned, keep the caller's form."""
    blocked = [node for node in canonical if block_ids_input(node) is not None]
    if not blocked:
        return canonical
    rest = [node for node in canonical if block_ids_input(node) is None]
    if kv_scales is not None:
        raise ExportError("--kv-cache int8 with image tokens that attend both ways (Gemma 3's images): ONNX Attention "
                          "has no quantised cache; export without --kv-cache, or with --text-only")
    from kvforge.exporter.targets.onnx import lower_to_onnx

    lower_to_onnx(graph, blocked)
    graph.opset_imports["com.microsoft"] = 1
    return rest
