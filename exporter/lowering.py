"""Lowering passes: rewrite each canonical attention node (kvforge.contract.CANONICAL_OP) for a target.

- `ort`:  com.microsoft.GroupQueryAttention (in place when past/present share one OrtValue).
- `onnx`: standard ONNX Attention (opset 24) + TensorScatter for the in-place cache update.
- `trt`:  kvforge's TensorRT plugin node (kvforge.contract.PLUGIN: its op type, plugin_namespace and
          plugin_version), implemented by the Triton kernel (plugins/trt_plugin.py); the same
          inputs, outputs and attributes as the canonical node.

Values that depend only on `past_lens` and the shapes (lengths, causal mask) are built once per
graph and shared by every layer's node.
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx_ir as ir

from kvforge.contract import (
    ATTENTION_OUTPUTS,
    CANONICAL_OP,
    INPUT_IDS,
    LOGITS_INDEX,
    PLUGIN,
    AttentionAttrs,
    parse_cache_name,
)
from kvforge.errors import ExportError, UnsupportedModelError
from kvforge.targets import Target

DOMAIN = CANONICAL_OP.domain  # the canonical node's domain, dropped from the graph once lowered


def _const(tape: ir.tape.Tape, array: np.ndarray, name: str | None = None) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(array, name=name)})


def _attrs(node: ir.Node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


def _canonical_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [node for node in graph if node.domain == CANONICAL_OP.domain and node.op_type == CANONICAL_OP.op_type]


def _replace(graph: ir.Graph, node: ir.Node, tape: ir.tape.Tape, new_outputs: list[ir.Value]) -> None:
    ir.convenience.replace_nodes_and_values(
        graph, node, [node], tape.nodes, list(node.outputs), new_outputs
    )


FUSION_DOMAIN = "ai.onnxruntime._fusion"  # onnxscript's intermediate RotaryEmbedding (exporter/fusions.py)
TRANSPOSE_BSHD = [0, 2, 1, 3]  # [B, S, H, D] <-> [B, H, S, D]


def _inputs(node: ir.Node) -> tuple[list[ir.Value], ir.Value | None]:
    """The canonical node's ATTENTION_INPUTS and its optional `sinks` input (None when absent)."""
    inputs = list(node.inputs)
    return inputs[:6], (inputs[6] if len(inputs) > 6 else None)


def _producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == domain else None


def _perm(node: ir.Node | None) -> list[int] | None:
    return list(node.attributes["perm"].value) if node is not None and "perm" in node.attributes else None


def _pre_rotary(value: ir.Value) -> tuple[ir.Value, ir.Node] | None:
    """If a canonical q/k input is Reshape(Transpose(RotaryEmbedding(Transpose(y)))) -- RoPE applied
    in the [B, H, S, D] layout to y [B, S, H, D] -- return y and the rotary node."""
    reshape = _producer(value, "Reshape")
    back = _producer(reshape.inputs[0], "Transpose") if reshape is not None else None
    if _perm(back) != TRANSPOSE_BSHD:
        return None
    # onnxscript's intermediate RotaryEmbedding, or ONNX Runtime's own where its cos/sin fusion already ran
    # (transformers 5.17's trace). Either way the table is the model's (rotary_caches checks it against the
    # module at every position) and the positions are past_lens + t: GQA's do_rotary computes the same.
    rotary = _producer(back.inputs[0], "RotaryEmbedding", FUSION_DOMAIN) or \
        _producer(back.inputs[0], "RotaryEmbedding", "com.microsoft")
    if rotary is None or rotary.attributes.get("interleaved", ir.AttrInt64("interleaved", 0)).value != 0 or \
            rotary.attributes.get("rotary_embedding_dim", ir.AttrInt64("rotary_embedding_dim", 0)).value != 0 or \
            rotary.attributes.get("scale", ir.AttrFloat32("scale", 1.0)).value != 1.0:
        return None
    forward = _producer(rotary.inputs[0], "Transpose")
    if _perm(forward) != TRANSPOSE_BSHD:
        return None
    return forward.inputs[0], rotary


def _split_output(value: ir.Value) -> tuple[ir.Node, int] | None:
    """The Split node and output index `value` is, looking through Reshapes and cancelling pairs of
    [B,S,H,D] <-> [B,H,S,D] transposes (layout only, no data change)."""
    transposes = 0
    while True:
        node = value.producer()
        if node is None:
            return None
        if node.op_type == "Reshape" and node.domain == "":
            value = node.inputs[0]
        elif node.op_type == "Transpose" and node.domain == "" and _perm(node) == TRANSPOSE_BSHD:
            transposes += 1
            value = node.inputs[0]
        elif node.op_type == "Split" and node.domain == "" and transposes % 2 == 0:
            return node, list(node.outputs).index(value)
        else:
            return None


def lower_to_ort(graph: ir.Graph, canonical: list[ir.Node], rotary: tuple[np.ndarray, np.ndarray] | None = None,
                 kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """GroupQueryAttention per layer. With `rotary` (cos and sin caches [max_pos, D/2] from the
    model's rotary embedding), RoPE moves into the attention op (do_rotary=1) wherever the graph
    applies it right before attention, and q/k/v that are the three parts of one fused MatMul are
    passed packed: one node per layer instead of a dozen layout and rotary ops. With `kv_scales`
    (per layer the key and value scales [1, H_kv, 1, D], exporter/kv_quant.py) the cache is int8:
    GQA quantises the rows it writes and dequantises what it reads, and the cache IO becomes int8."""
    first = canonical[0]
    q0, past_lens = first.inputs[0], first.inputs[5]
    # The query length from the graph's input_ids, not from layer 0's q: that would keep layer 0's
    # rotary path alive after it is folded into attention.
    ids = next((value for value in graph.inputs if value.name == INPUT_IDS), q0)
    shared = ir.tape.Tape()
    # decode.onnx: input_ids [B, 1] and no logits_index (exporter/trace.py: derive_decode_graph).
    one_token = (ids.shape is not None and len(ids.shape) == 2 and ids.shape[1] == 1) or (
        ids is not q0 and LOGITS_INDEX not in {value.name for value in graph.inputs})
    if one_token:
        # decode.onnx (one new token per row): seqlens_k ("total length - 1") is past_lens itself, and
        # total_sequence_length, which GQA reads on the host, is the cache's capacity from past_key's
        # shape. So no device value is copied to the host mid-graph (a Memcpy node, which also rules out
        # ONNX Runtime's CUDA graphs), and the step is never mistaken for a first prompt (GQA's test is
        # S == total_sequence_length). The kernels attend each row's own seqlens_k + 1 positions.
        seqlens_k = past_lens
        capacity = shared.op("Shape", [first.inputs[3]], attributes={"start": 2, "end": 3})
        total_len = shared.op("Cast", [capacity], attributes={"to": ir.DataType.INT32})
    else:
        seq = shared.op("Shape", [ids], attributes={"start": 1, "end": 2})
        seq32 = shared.op("Cast", [seq], attributes={"to": ir.DataType.INT32})
        total = shared.op("Add", [past_lens, seq32])  # [B] tokens in the cache after this call
        # GQA's seqlens_k is "total length - 1" per row; with right padding the padded positions are
        # written too, but real tokens never attend them (causal) and decode overwrites them later.
        # With do_rotary, GQA rotates token t of row b at position seqlens_k[b] + 1 - S + t = past_lens[b] + t.
        seqlens_k = shared.op("Sub", [total, _const(shared, np.array([1], np.int32), "kvforge_one")])
        total_len = shared.op("ReduceMax", [total], attributes={"keepdims": 0})
    caches = None
    if rotary is not None:
        dtype = q0.dtype.numpy() if q0.dtype is not None else np.float32
        caches = [_const(shared, table.astype(dtype), f"kvforge_rotary_{kind}") for kind, table in zip(("cos", "sin"), rotary, strict=True)]
    graph.insert_before(first, shared.nodes)

    for node in canonical:
        attrs = _attrs(node)
        (q, k, v, past_key, past_value, _), sinks = _inputs(node)
        tape = ir.tape.Tape()
        do_rotary = 0
        rotary_inputs: list[ir.Value | None] = [None, None]
        pre_q, pre_k = (_pre_rotary(q), _pre_rotary(k)) if caches is not None else (None, None)
        if pre_q is not None and pre_k is not None:
            do_rotary = 1
            flat = _const(tape, np.array([0, 0, -1], np.int64), None)
            q = tape.op("Reshape", [pre_q[0], flat])
            k = tape.op("Reshape", [pre_k[0], flat])
            rotary_inputs = list(caches)
            parts = [_split_output(value) for value in (q, k, v)]
            if all(parts) and len({id(p[0]) for p in parts}) == 1 and [p[1] for p in parts] == [0, 1, 2] \
                    and len(parts[0][0].outputs) == 3:
                q, k, v = parts[0][0].inputs[0], None, None  # packed [B, S, (H + 2 Hkv) * D]
        quant: dict[str, int | str] = {}
        scales: list[ir.Value] = []
        if kv_scales is not None:
            cache_name = parse_cache_name(past_key.name or "")
            if cache_name is None:
                raise ExportError(f"attention node {node.name} does not read a graph cache input; cannot quantise its cache")
            scales = [_const(tape, scale, None) for scale in kv_scales[cache_name[2]]]
            quant = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
        # GQA's optional inputs: cos_cache, sin_cache, position_ids, attention_bias, head_sink, k_scale, v_scale.
        extra = [*rotary_inputs, None, None, sinks, *scales]
        while extra and extra[-1] is None:
            extra.pop()
        out, present_key, present_value = tape.op_multi_out(
            "GroupQueryAttention",
            [q, k, v, past_key, past_value, seqlens_k, total_len, *extra],
            attributes={
                "num_heads": attrs["num_heads"],
                "kv_num_heads": attrs["kv_num_heads"],
                "scale": attrs["scale"],
                "softcap": attrs["softcap"],
                # Same W as HF's sliding_window (a query sees itself and W-1 earlier positions);
                # tests check it against HF eager with a window shorter than the sequence.
                "local_window_size": attrs["sliding_window"] if attrs["sliding_window"] > 0 else -1,
                "do_rotary": do_rotary,
                "rotary_interleaved": 0,
                **quant,
            },
            domain="com.microsoft",
            num_outputs=3,
        )
        _replace(graph, node, tape, [out, present_key, present_value])
    if kv_scales is not None:
        for value in [*graph.inputs, *graph.outputs]:
            if parse_cache_name(value.name or "") is not None:
                value.dtype = ir.DataType.INT8
    graph.opset_imports["com.microsoft"] = 1


def lower_to_onnx(graph: ir.Graph, canonical: list[ir.Node]) -> None:
    if graph.opset_imports.get("", 0) < 24:
        raise ExportError("the `onnx` target needs the graph exported at opset >= 24 (Attention + TensorScatter)")
    first = canonical[0]
    q0, past_key0, past_lens = first.inputs[0], first.inputs[3], first.inputs[5]
    shared = ir.tape.Tape()
    zero = _const(shared, np.array(0, np.int64), "kvforge_zero")
    one = _const(shared, np.array(1, np.int64), "kvforge_one")
    seq = shared.op("Squeeze", [shared.op("Shape", [q0], attributes={"start": 1, "end": 2})])
    capacity = shared.op("Squeeze", [shared.op("Shape", [past_key0], attributes={"start": 2, "end": 3})])
    write_index = shared.op("Cast", [past_lens], attributes={"to": ir.DataType.INT64})  # [B]
    # positions[b, t] = past_lens[b] + t ; cache_pos[c] = c
    positions = shared.op(
        "Add",
        [
            shared.op("Unsqueeze", [write_index, _const(shared, np.array([1], np.int64), "kvforge_axis1")]),
            shared.op("Range", [zero, seq, one]),
        ],
    )
    query_pos = shared.op("Unsqueeze", [positions, _const(shared, np.array([1, 3], np.int64), "kvforge_axes13")])
    cache_pos = shared.op("Range", [zero, capacity, one])  # broadcasts as [1, 1, 1, C]
    causal = shared.op("LessOrEqual", [cache_pos, query_pos])  # [B, 1, S, C]
    graph.insert_before(first, shared.nodes)

    masks: dict[int, ir.Value] = {0: causal}
    sink_masks: dict[int, ir.Value] = {}
    for node in canonical:
        attrs = _attrs(node)
        (q, k, v, past_key, past_value, _), sinks = _inputs(node)
        heads, kv_heads, window = attrs["num_heads"], attrs["kv_num_heads"], attrs["sliding_window"]
        tape = ir.tape.Tape()
        if window not in masks:
            lower = tape.op("Sub", [query_pos, _const(tape, np.array(window, np.int64), f"kvforge_window{window}")])
            masks[window] = tape.op("And", [causal, tape.op("Greater", [cache_pos, lower])])

        def heads_first(x: ir.Value, n: int, tape: ir.tape.Tape = tape) -> ir.Value:
            shape = _const(tape, np.array([0, 0, n, -1], np.int64), None)
            return tape.op("Transpose", [tape.op("Reshape", [x, shape])], attributes={"perm": [0, 2, 1, 3]})

        present_key = tape.op("TensorScatter", [past_key, heads_first(k, kv_heads), write_index], attributes={"axis": 2})
        present_value = tape.op(
            "TensorScatter", [past_value, heads_first(v, kv_heads), write_index], attributes={"axis": 2}
        )
        attention = {"scale": attrs["scale"]}
        if attrs["softcap"] > 0:
            attention["softcap"] = attrs["softcap"]
        keys, values, mask = present_key, present_value, masks[window]
        if sinks is not None:
            if attrs["softcap"] > 0:
                raise ExportError(f"attention node {node.name} has both sinks and a softcap; the `onnx` target's "
                                  "Attention would cap the sink too")
            keys, values, mask = _with_sink_column(tape, present_key, present_value, mask, sinks, query_pos, heads,
                                                   q.dtype, sink_masks, window)
        y = tape.op("Attention", [heads_first(q, heads), keys, values, mask], attributes=attention)
        out = tape.op(
            "Reshape",
            [
                tape.op("Transpose", [y], attributes={"perm": [0, 2, 1, 3]}),
                _const(tape, np.array([0, 0, -1], np.int64), None),
            ],
        )
        _replace(graph, node, tape, [out, present_key, present_value])


def _with_sink_column(tape: ir.tape.Tape, present_key: ir.Value, present_value: ir.Value, mask: ir.Value,
                      sinks: ir.Value, query_pos: ir.Value, heads: int, dtype: ir.DataType | None,
                      float_masks: dict[int, ir.Value], window: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """ONNX Attention has no sinks: give it one more cache column whose key and value are zero, so its
    score is 0, and an additive mask whose last column is the head's sink logit. The softmax then
    includes exp(sink) and the extra value adds nothing, which is the sink's definition. The column
    costs a copy of the layer's cache per call; the `ort` target passes sinks to GQA instead."""
    np_dtype = dtype.numpy() if dtype is not None else np.float32
    if window not in float_masks:  # [B, H, S, C]: 0 where allowed, the lowest finite value elsewhere
        blocked = tape.op("Where", [mask, _const(tape, np.array(0, np_dtype), None),
                                    _const(tape, np.array(np.finfo(np_dtype).min, np_dtype), None)])
        float_masks[window] = tape.op("Expand", [blocked, _const(tape, np.array([1, heads, 1, 1], np.int64), None)])
    head_sinks = tape.op("Reshape", [sinks, _const(tape, np.array([1, heads, 1, 1], np.int64), None)])
    sink_column = tape.op("Expand", [head_sinks, tape.op("Shape", [query_pos])])  # [B, H, S, 1]
    float_mask = tape.op("Concat", [float_masks[window], sink_column], attributes={"axis": 3})
    cache_shape = tape.op("Shape", [present_key])
    row_shape = tape.op("Concat", [tape.op("Slice", [cache_shape, _const(tape, np.array([0], np.int64), None),
                                                      _const(tape, np.array([2], np.int64), None)]),
                                   _const(tape, np.array([1], np.int64), None),
                                   tape.op("Slice", [cache_shape, _const(tape, np.array([3], np.int64), None),
                                                      _const(tape, np.array([4], np.int64), None)])],
                        attributes={"axis": 0})
    zero_row = tape.op("ConstantOfShape", [row_shape], attributes={"value": ir.tensor(np.zeros(1, np_dtype))})
    keys = tape.op("Concat", [present_key, zero_row], attributes={"axis": 2})
    values = tape.op("Concat", [present_value, zero_row], attributes={"axis": 2})
    return keys, values, float_mask


def lower_to_trt(graph: ir.Graph, canonical: list[ir.Node]) -> None:
    """The plugin node per layer. TensorRT's ONNX parser ignores node domains and finds a plugin by op
    type plus the node attributes plugin_namespace / plugin_version; the node's domain is the one
    onnxruntime-extensions' Python ops use, so the CPU emulation (runtime/emulate.py) serves the very
    same node."""
    for node in canonical:
        if _inputs(node)[1] is not None:
            raise UnsupportedModelError("the model's attention has sinks, which kvforge's TensorRT kernel does not "
                                        "implement; use --target ort or --target onnx")
        attrs = AttentionAttrs.from_mapping(_attrs(node))
        tape = ir.tape.Tape()
        outputs = tape.op_multi_out(
            PLUGIN.name,
            list(node.inputs),
            attributes={**PLUGIN.node_attributes(), **attrs.as_dict()},
            domain=PLUGIN.onnx_domain,
            num_outputs=len(ATTENTION_OUTPUTS),
        )
        _replace(graph, node, tape, list(outputs))
    graph.opset_imports[PLUGIN.onnx_domain] = 1


def lower(model: ir.Model, target: Target, rotary: tuple[np.ndarray, np.ndarray] | None = None,
          kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
          moe_quantize: tuple[int, int] | None = None) -> ir.Model:
    """Rewrite every canonical attention node of `model` in place with `target`'s pass (the function
    its registry entry names). `rotary`: the model's cos/sin caches, which targets with ONNX Runtime's
    fusions fold into their attention op; `kv_scales`: a quantised cache's scales per layer (targets
    whose `kv_cache_dtypes` name one); `moe_quantize`: (bits, block_size) for the experts' weights
    (targets that `quantize`)."""
    module, name = target.lowering.split(":")
    lowering = getattr(importlib.import_module(module), name)
    graph = model.graph
    canonical = _canonical_nodes(graph)
    if not canonical:
        raise ExportError("the exported graph has no kvforge attention node; attention was not routed through the op")
    if kv_scales is not None:
        if not target.kv_cache_dtypes:
            raise ExportError(f"the {target.name} target has no quantised KV cache")
        lowering(graph, canonical, rotary, kv_scales)
    elif target.ort_fusions:
        lowering(graph, canonical, rotary)
    else:
        lowering(graph, canonical)
    module, name = target.moe_lowering.split(":")
    moe_lowering = getattr(importlib.import_module(module), name)
    moe_lowering(graph, moe_quantize) if moe_quantize is not None else moe_lowering(graph)
    graph.opset_imports.pop(DOMAIN, None)
    # The rotary and layout ops folded into attention are now unused (and the fusion's functions).
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.passes.common.RemoveUnusedFunctionsPass()(model)
    ir.passes.common.RemoveUnusedOpsetsPass()(model)
    return model
