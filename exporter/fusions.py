"""Graph fusions applied to the canonical graph before lowering, for fewer and larger ops per step.

A decode step of a small model is bound by per-op overhead as much as by weight bandwidth: the traced
graph runs ~50 ops per layer (RMSNorm as Pow/ReduceMean/Add/Sqrt/Div/Mul, three q/k/v MatMuls, two
gate/up MatMuls, rotary as Slice/Neg/Concat/Mul/Add, ...). These passes shrink that:

- `fuse_parallel_matmuls` (every target): MatMuls that read the same input with constant weights
  (q/k/v; gate/up) become one MatMul over the concatenated weights and a Split: one read of the
  activations, one larger, better-vectorised GEMM.
- `fuse_for_ort` (`ort` target): onnxscript's ONNX Runtime fusions for RMSNorm
  (SimplifiedLayerNormalization), residual-add + RMSNorm (SkipSimplifiedLayerNormalization) and
  rotary embeddings (com.microsoft.RotaryEmbedding with a cos/sin cache).

Every fusion is numerically the same computation; the parity tests run on fused exports.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir


def _constant_weight(value: ir.Value) -> np.ndarray | None:
    tensor = value.const_value
    if tensor is None or value.producer() is not None and value.producer().op_type != "Constant":
        return None
    array = tensor.numpy()
    return array if array.ndim == 2 else None


def fuse_parallel_matmuls(model: ir.Model) -> int:
    """Merge MatMuls that share their input and have 2-D constant weights of one dtype. Returns how
    many groups were merged."""
    graph = model.graph
    groups: dict[int, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2:
            weight = node.inputs[1]
            if weight is not None and weight.const_value is not None and weight.is_initializer():
                groups[id(node.inputs[0])].append(node)
    merged = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        weights = [node.inputs[1].const_value.numpy() for node in nodes]
        if len({w.dtype for w in weights}) != 1 or len({w.shape[0] for w in weights}) != 1 or any(
            w.ndim != 2 for w in weights
        ):
            continue
        first = nodes[0]
        fused = np.concatenate(weights, axis=1)
        name = f"kvforge_fused_{first.inputs[1].name}"
        value = ir.Value(name=name, shape=ir.Shape(list(fused.shape)), type=first.inputs[1].type,
                         const_value=ir.tensor(fused, name=name))
        graph.register_initializer(value)
        tape = ir.tape.Tape()
        product = tape.op("MatMul", [first.inputs[0], value])
        split = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([w.shape[1] for w in weights], np.int64))})
        parts = tape.op_multi_out("Split", [product, split], attributes={"axis": -1}, num_outputs=len(nodes))
        # Insert before the earliest consumer of any output, i.e. right before the first MatMul.
        graph.insert_before(first, tape.nodes)
        for node, part in zip(nodes, parts, strict=True):
            old = node.outputs[0]
            part.dtype, part.shape = old.dtype, old.shape
            old.replace_all_uses_with(part)
            if old.is_graph_output():
                index = list(graph.outputs).index(old)
                part.name = old.name
                graph.outputs[index] = part
        for node in nodes:
            graph.remove(node, safe=True)
        merged += 1
    if merged:
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return merged


def fuse_for_ort(model: ir.Model) -> dict[str, int]:
    """ONNX Runtime's normalization and rotary fusions (onnxscript's rewrite rules)."""
    from onnxscript.rewriter.ort_fusions.cos_sin_cache import fuse_cos_sin_cache
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    counts = {
        "rms_normalization": fuse_rms_normalization(model),
        "skip_rms_normalization": fuse_skip_rms_normalization(model),
        "rotary_embedding": fuse_rotary_embedding(model),
        "cos_sin_cache": fuse_cos_sin_cache(model),
    }
    return counts
