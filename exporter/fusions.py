"""Graph fusions applied to the canonical graph before lowering, for fewer and larger ops per step.

A decode step of a small model is bound by per-op overhead as much as by weight bandwidth: the traced
graph runs ~50 ops per layer (RMSNorm as Pow/ReduceMean/Add/Sqrt/Div/Mul, three q/k/v MatMuls, two
gate/up MatMuls, rotary as Slice/Neg/Concat/Mul/Add, ...). These passes shrink that:

- `fuse_parallel_matmuls` (every target): the q/k/v MatMuls, which read the same input with constant
  weights, become one MatMul over the concatenated weights and a Split (which the `ort` lowering
  then removes by passing the packed result to attention). Quantised exports merge the gate/up pairs
  too: each MatMulNBits quantises its input to int8 (accuracy_level 4), so a merged pair does that
  once instead of twice.
- `fuse_for_ort` (`ort` target): onnxscript's ONNX Runtime fusions for RMSNorm
  (SimplifiedLayerNormalization), residual-add + RMSNorm (SkipSimplifiedLayerNormalization) and
  rotary embeddings (com.microsoft.RotaryEmbedding with a cos/sin cache).

Every fusion is numerically the same computation; the parity tests run on fused exports.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from kvforge.exporter.graph_edit import PARTS_META, take_over
from kvforge.exporter.lazy_weights import lazy, transposed


def fuse_parallel_matmuls(model: ir.Model, group_size: int = 3) -> int:
    """Merge `group_size` MatMuls that share their input and have 2-D constant weights of one dtype
    (3: q/k/v; 2: gate/up). fp32 exports leave the pairs alone: on ONNX Runtime's CPU MatMul the
    merged GEMM gains nothing once its output is split back (SmolLM2-135M: 0.999x), while int4's
    MatMulNBits decodes 4.9% faster merged (benchmarks/README.md). Returns how many groups were merged."""
    graph = model.graph
    groups: dict[int, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2:
            weight = node.inputs[1]
            if weight is not None and weight.const_value is not None and weight.is_initializer():
                groups[id(node.inputs[0])].append(node)
    merged = 0
    for nodes in groups.values():
        if len(nodes) != group_size:
            continue
        # Shapes and dtypes only: the weights may be lazy reads of the checkpoint (exporter/lazy_weights.py).
        weights = [node.inputs[1].const_value for node in nodes]
        shapes = [tuple(w.shape) for w in weights]
        if len({w.dtype for w in weights}) != 1 or any(len(shape) != 2 for shape in shapes) or \
                len({shape[0] for shape in shapes}) != 1:
            continue
        first = nodes[0]
        fused_shape = (shapes[0][0], sum(shape[1] for shape in shapes))
        name = f"kvforge_fused_{first.inputs[1].name}"
        fused = lazy(lambda weights=weights: np.concatenate([w.numpy() for w in weights], axis=1), weights[0].dtype,
                     fused_shape, name)
        value = ir.Value(name=name, shape=ir.Shape(list(fused_shape)), type=first.inputs[1].type, const_value=fused)
        value.meta[PARTS_META] = [node.inputs[1].name for node in nodes]  # an import finds each part's integers
        graph.register_initializer(value)
        tape = ir.tape.Tape()
        product = tape.op("MatMul", [first.inputs[0], value])
        split = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([s[1] for s in shapes], np.int64))})
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


def drop_reshape_round_trips(model: ir.Model) -> int:
    """Reshape(Reshape(x)) whose result has x's own shape (e.g. attention output [B, S, H*D] viewed
    as [B, S, H, D] and back) is x. Shapes are the exporter's, symbolic dims compared by name."""
    graph, dropped = model.graph, 0
    for outer in list(graph):
        if outer.op_type != "Reshape" or outer.domain != "":
            continue
        inner = outer.inputs[0].producer()
        if inner is None or inner.op_type != "Reshape" or inner.domain != "" or len(inner.outputs[0].uses()) != 1:
            continue
        source, result = inner.inputs[0], outer.outputs[0]
        if source.shape is None or result.shape is None or source.shape != result.shape or result.is_graph_output():
            continue
        result.replace_all_uses_with(source)
        dropped += 1
    if dropped:
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return dropped


def rotary_caches(model, max_positions: int, dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """cos and sin caches [max_positions, head_dim / 2] for a HF model's rotary embedding (rope
    scaling and attention scaling included), or None where the model has no single, half-duplicated
    rotary table (then RoPE stays in the graph).

    The tables are a fixed function of the module's own fp32 `inv_freq` and `attention_scaling`,
    computed with numpy, not by running the module: HF's angle (fp32 position times fp32 inv_freq,
    one IEEE multiply, so the same bits on every machine), then cos/sin of that angle in float64,
    rounded once to fp32. Running the module would take cos/sin from whichever vectorised kernel
    the torch build picks for the CPU (MKL's VML, SLEEF, libm), each off by an ulp in a different ~5%
    of the entries; an export must not depend on the machine or process it runs in. The module's own tables (what HF eager uses at run time) still decide whether the fold is
    valid: ours must match them to within rounding, else RoPE stays in the graph."""
    import torch

    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    # One table for every layer and every call: not Gemma 3's per-layer-type tables (rope_type is a
    # dict there), nor LongRoPE's, which switches tables with the length of the call (and would
    # switch the model's own buffer if asked for all positions at once).
    if rope is None or not isinstance(getattr(rope, "rope_type", None), str) or rope.rope_type in ("longrope", "dynamic"):
        return None
    config = model.config
    try:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - set per layer (Gemma 4): no one table to fuse
        return None
    inv_freq = rope.inv_freq.detach().float().cpu().numpy()  # HF's forward casts it to fp32 too
    if 2 * inv_freq.shape[-1] != head_dim:
        return None  # partial rotary (Phi-4-mini): RoPE stays in the graph
    scaling = float(getattr(rope, "attention_scaling", 1.0))
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # fp32, as HF
    cos = (np.cos(angles.astype(np.float64)) * scaling).astype(np.float32)
    sin = (np.sin(angles.astype(np.float64)) * scaling).astype(np.float32)
    with torch.no_grad():
        hf_cos, hf_sin = rope(torch.zeros(1, dtype=torch.float32), torch.arange(max_positions)[None])
    hf_cos, hf_sin = hf_cos[0].float().numpy(), hf_sin[0].float().numpy()
    # torch's cos/sin are within an ulp or two of ours (~1e-7); a module that computes its table
    # some other way (another angle, no half duplication) differs by far more.
    tolerance = 1e-6 * max(1.0, abs(scaling))
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        full = np.concatenate([ours, ours], axis=-1)
        if theirs.shape != full.shape or not np.abs(theirs - full).max() <= tolerance:
            return None
    return cos.astype(dtype), sin.astype(dtype)


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
    counts["norm_statistics_dropped"] = drop_unused_norm_statistics(model)
    counts["norm_dtypes_aligned"] = align_norm_dtypes(model)
    return counts


_NORM_WEIGHTS = {"SimplifiedLayerNormalization": (1,), "SkipSimplifiedLayerNormalization": (2, 3)}


def align_norm_dtypes(model: ir.Model) -> int:
    """Give each fused RMSNorm one dtype, its input's. Some families' norms multiply by the weight in
    fp32 whatever the model's dtype (Gemma's 1 + w, OLMo 2, Gemma 2/3: `weight.float()`), so in an fp16
    export the fusion sees fp16 activations, an fp32 weight and an fp32 result, then a Cast back to fp16;
    SkipSimplifiedLayerNormalization has one type for all of them and such a graph does not load.
    The weight becomes a copy in the input's dtype, the result that dtype (ONNX Runtime normalises in
    fp32 inside the op and rounds once, where HF rounded after the fp32 product: within an ulp), the
    Cast back becomes the identity it now is. Returns how many nodes changed."""
    graph, changed = model.graph, 0
    copies: dict[tuple[str, ir.DataType], ir.Value] = {}
    for node in list(graph):
        weights = _NORM_WEIGHTS.get(node.op_type) if node.domain in ("", "com.microsoft") else None
        dtype = node.inputs[0].dtype if weights is not None else None
        if dtype is None:
            continue
        touched = False
        for slot in weights:
            if slot >= len(node.inputs) or node.inputs[slot] is None or node.inputs[slot].dtype == dtype:
                continue
            weight = node.inputs[slot]
            if weight.const_value is None or not weight.is_initializer():
                raise_mixed(node)
            key = (weight.name, dtype)
            if key not in copies:
                name = f"{weight.name}.{dtype.name.lower()}"
                source = weight.const_value
                cast = lazy(lambda source=source, dtype=dtype: source.numpy().astype(dtype.numpy()), dtype,
                            tuple(source.shape), name)
                copies[key] = ir.Value(name=name, shape=weight.shape, type=ir.TensorType(dtype), const_value=cast)
                graph.register_initializer(copies[key])
            node.replace_input_with(slot, copies[key])
            touched = True
        for index in (0, 3):
            if index < len(node.outputs) and node.outputs[index].name and node.outputs[index].dtype != dtype:
                _retype_output(graph, node.outputs[index], dtype)
                touched = True
        changed += touched
    if changed:
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return changed


def _retype_output(graph: ir.Graph, value: ir.Value, dtype: ir.DataType) -> None:
    """`value` is now `dtype`: a Cast of it to `dtype` is dropped, other users get a Cast to its old type."""
    old = value.dtype
    value.dtype = dtype
    for user, slot in list(value.uses()):
        if user.op_type == "Cast" and user.domain == "" and user.attributes["to"].value == dtype and \
                not user.outputs[0].is_graph_output():
            user.outputs[0].replace_all_uses_with(value)
            continue
        tape = ir.tape.Tape()
        back = tape.op("Cast", [value], attributes={"to": old})
        back.dtype, back.shape = old, value.shape
        graph.insert_before(user, tape.nodes)
        user.replace_input_with(slot, back)


def raise_mixed(node: ir.Node) -> None:
    from kvforge.core.errors import ExportError

    raise ExportError(f"{node.op_type} node {node.name} mixes dtypes with a weight computed in the graph; "
                      "kvforge cannot align it (export with --dtype fp32)")


def drop_unused_norm_statistics(model: ir.Model) -> int:
    """Make SkipSimplifiedLayerNormalization's unused optional outputs absent (""): mean / inv_std_var
    (1, 2: training statistics the fusion declares) and the last norm's residual sum (3). ONNX Runtime
    otherwise allocates and writes them for every norm at every step (SmolLM2-135M: 120 tensors a step; dropping them took decode from 24.5 to
    23.6 ms per step on fp32 and 6.4 to 6.1 ms on int4, benchmarks/README.md). Returns how many."""
    dropped = 0
    for node in model.graph:
        if node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != "com.microsoft":
            continue
        for value in node.outputs[1:]:
            if value.name and not value.uses() and not value.is_graph_output():
                value.name = ""  # serialised as an absent optional output
                dropped += 1
    return dropped


def pretranspose_tied_lm_head(model: ir.Model) -> int:
    """A tied lm_head reads the embedding through Transpose -> MatMul. ONNX Runtime's CPU then runs a
    FusedMatMul with transB over the embedding, about 4% slower a decode step than a MatMul over a
    [H, V] table (SmolLM2-135M fp32, A/Bs in both orders; benchmarks/README.md), and folding the Transpose
    at session creation costs ~0.3 s on every start. So the export stores the table transposed, once: the
    lm_head multiplies by it, and the embedding looks its rows up as columns (Gather on axis 1, then the
    gathered [H, ...ids] moved back to [...ids, H]). The same values, one copy in the weights file (the
    embedding is the largest tensor of most models). Returns how many tables were transposed."""
    stored = 0
    graph = model.graph
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "" or list(node.attributes.get_ints("perm", [])) != [1, 0]:
            continue
        source = node.inputs[0]
        tensor = source.const_value if source is not None and source.is_initializer() else None
        if tensor is None or len(tensor.shape) != 2 or \
                not all(use.op_type == "MatMul" and slot == 1 for use, slot in node.outputs[0].uses()):
            continue
        lookups = [use for use, slot in source.uses() if use is not node]
        if not all(_columns_lookup_possible(use, slot) for use, slot in source.uses() if use is not node):
            continue
        name = f"{source.name}.transposed"
        shape = tuple(tensor.shape)[::-1]
        table = transposed(tensor, None, name)
        copy = ir.Value(name=name, shape=ir.Shape(list(shape)), type=source.type, const_value=table)
        graph.register_initializer(copy)
        node.outputs[0].replace_all_uses_with(copy)
        graph.remove(node, safe=True)
        for lookup in lookups:
            _lookup_columns(graph, lookup, copy)
        stored += 1
    if stored:
        ir.passes.common.RemoveUnusedNodesPass()(model)  # and the [V, H] table no node reads any more
    return stored


def _columns_lookup_possible(node: ir.Node, slot: int) -> bool:
    """The table's other use is an embedding lookup (Gather on axis 0) with ids of a known rank."""
    ids = node.inputs[1] if len(node.inputs) > 1 else None
    return node.op_type == "Gather" and node.domain == "" and slot == 0 and \
        node.attributes.get_int("axis", 0) == 0 and ids is not None and ids.shape is not None


def _lookup_columns(graph: ir.Graph, lookup: ir.Node, table: ir.Value) -> None:
    """Gather(W, ids) on axis 0 -> Transpose(Gather(W^T, ids, axis=1)): [H, ...ids] moved to [...ids, H]."""
    rank = len(lookup.inputs[1].shape)
    tape = ir.tape.Tape()
    columns = tape.op("Gather", [table, lookup.inputs[1]], attributes={"axis": 1})
    rows = tape.op("Transpose", [columns], attributes={"perm": [*range(1, rank + 1), 0]})
    graph.insert_before(lookup, tape.nodes)
    take_over(graph, lookup, rows)
