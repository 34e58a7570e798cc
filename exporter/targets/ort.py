"""The `ort` target: com.microsoft.GroupQueryAttention per layer (in place when past and present are one
OrtValue), with RoPE and packed q/k/v folded into it, ONNX Runtime's normalization fusions, MatMulNBits
weights (`--quantize`), an int8 KV cache (`--kv-cache int8`), and ONNX Runtime's MoE op for experts."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.core.contract import INPUT_IDS, LOGITS_INDEX, parse_cache_name
from kvforge.core.errors import ExportError
from kvforge.core.targets import TARGETS
from kvforge.exporter.graph_edit import (
    attention_inputs,
    constant,
    node_attributes,
    pre_rotary,
    replace_node,
    split_output,
)
from kvforge.exporter.targets.base import ExportTarget, alibi_bias, alibi_input, bias_input, shared_key
from kvforge.exporter.targets.block_attention import lower_image_blocks

# The head sizes GroupQueryAttention applies RoPE itself for (do_rotary=1).
ROTARY_HEAD_MULTIPLE = 16


def lower_to_ort(graph: ir.Graph, canonical: list[ir.Node], rotary: tuple[np.ndarray, np.ndarray] | None = None,
                 kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """GroupQueryAttention per layer. With `rotary` (cos and sin caches [max_pos, D/2] from the
    model's rotary embedding), RoPE moves into the attention op (do_rotary=1) wherever the graph
    applies it right before attention to heads of a multiple of 16 (GQA's own limit), and q/k/v that
    are the three parts of one fused MatMul are passed packed: one node per layer instead of a dozen
    layout and rotary ops. With `kv_scales`
    (per layer the key and value scales [1, H_kv, 1, D], exporter/quantization/kv_cache.py) the cache is int8:
    GQA quantises the rows it writes and dequantises what it reads, and the cache IO becomes int8. Nodes with
    image blocks (`block_ids`, Gemma 3's prefill) take the `onnx` target's form (exporter/image_blocks.py says why)."""
    canonical = lower_image_blocks(graph, canonical, kv_scales)
    if not canonical:
        return
    first = canonical[0]
    shared = ir.tape.Tape()
    seqlens_k, total_len = _lengths(graph, first, shared)
    caches = None
    if rotary is not None:
        q0 = first.inputs[0]
        dtype = q0.dtype.numpy() if q0.dtype is not None else np.float32
        caches = [constant(shared, table.astype(dtype), f"kvforge_rotary_{kind}") for kind, table in zip(("cos", "sin"), rotary, strict=True)]
    # ALiBi: query positions [B, 1, S, 1] and key positions [T] for GQA's attention_bias, whose last dim is
    # total_sequence_length (the capacity in decode.onnx), built once; one bias per distinct set of slopes.
    alibi_positions = _alibi_positions(graph, first, shared, total_len) \
        if any(alibi_input(node) is not None for node in canonical) else None
    biases: dict[object, ir.Value] = {}
    graph.insert_before(first, shared.nodes)

    for node in canonical:
        attrs = node_attributes(node)
        (q, k, v, past_key, past_value, _), sinks = attention_inputs(node)
        tape = ir.tape.Tape()
        # GQA folds RoPE in (do_rotary) for head sizes that are multiples of 16 only ("head_size shall be a
        # multiple of 16"); a smaller multiple of 8 keeps the graph's own rotary ops.
        head_size = past_key.shape[-1] if past_key.shape is not None else None
        foldable = isinstance(head_size, int) and head_size % ROTARY_HEAD_MULTIPLE == 0
        q, k, v, rotary_inputs = _operands(tape, q, k, v, caches if foldable else None)
        do_rotary = int(rotary_inputs[0] is not None)
        quant: dict[str, int | str] = {}
        scales: list[ir.Value] = []
        if kv_scales is not None:
            cache_name = parse_cache_name(past_key.name or "")
            if cache_name is None:
                raise ExportError(f"attention node {node.name} does not read a graph cache input; cannot quantise its cache")
            scales = [constant(tape, scale, None) for scale in kv_scales[cache_name[2]]]
            quant = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
        bias = _attention_bias(tape, node, attrs["num_heads"], q.dtype, alibi_positions, total_len, biases)
        # GQA's optional inputs: cos_cache, sin_cache, position_ids, attention_bias, head_sink, k_scale, v_scale.
        extra = [*rotary_inputs, None, bias, sinks, *scales]
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
        replace_node(graph, node, tape, [out, present_key, present_value])
    if kv_scales is not None:
        for value in [*graph.inputs, *graph.outputs]:
            if parse_cache_name(value.name or "") is not None:
                value.dtype = ir.DataType.INT8
    graph.opset_imports["com.microsoft"] = 1


def _lengths(graph: ir.Graph, first: ir.Node, shared: ir.tape.Tape) -> tuple[ir.Value, ir.Value]:
    """GroupQueryAttention's seqlens_k and total_sequence_length, built once for every layer's node."""
    q0, past_lens = first.inputs[0], first.inputs[5]
    # The query length from the graph's input_ids, not from layer 0's q: that would keep layer 0's
    # rotary path alive after it is folded into attention.
    ids = next((value for value in graph.inputs if value.name == INPUT_IDS), q0)
    # decode.onnx: input_ids [B, 1] and no logits_index (exporter/trace.py: derive_decode_graph).
    one_token = (ids.shape is not None and len(ids.shape) == 2 and ids.shape[1] == 1) or (
        ids is not q0 and LOGITS_INDEX not in {value.name for value in graph.inputs})
    if one_token:
        # decode.onnx (one new token per row): seqlens_k ("total length - 1") is past_lens itself, and
        # total_sequence_length, which GQA reads on the host, is the cache's capacity from past_key's
        # shape. So no device value is copied to the host mid-graph (a Memcpy node, which also rules out
        # ONNX Runtime's CUDA graphs), and the step is never mistaken for a first prompt (GQA's test is
        # S == total_sequence_length). The kernels attend each row's own seqlens_k + 1 positions.
        capacity = shared.op("Shape", [first.inputs[3]], attributes={"start": 2, "end": 3})
        return past_lens, shared.op("Cast", [capacity], attributes={"to": ir.DataType.INT32})
    seq = shared.op("Shape", [ids], attributes={"start": 1, "end": 2})
    seq32 = shared.op("Cast", [seq], attributes={"to": ir.DataType.INT32})
    total = shared.op("Add", [past_lens, seq32])  # [B] tokens in the cache after this call
    # GQA's seqlens_k is "total length - 1" per row; with right padding the padded positions are
    # written too, but real tokens never attend them (causal) and decode overwrites them later.
    # With do_rotary, GQA rotates token t of row b at position seqlens_k[b] + 1 - S + t = past_lens[b] + t.
    seqlens_k = shared.op("Sub", [total, constant(shared, np.array([1], np.int32), "kvforge_one")])
    return seqlens_k, shared.op("ReduceMax", [total], attributes={"keepdims": 0})


def _alibi_positions(graph: ir.Graph, first: ir.Node, shared: ir.tape.Tape,
                     total_len: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Query positions past_lens[b] + t as [B, 1, S, 1] and key positions 0 .. total_sequence_length - 1 (int64)."""
    q0, past_lens = first.inputs[0], first.inputs[5]
    ids = next((value for value in graph.inputs if value.name == INPUT_IDS), q0)
    zero = constant(shared, np.array(0, np.int64), "kvforge_alibi_zero")
    one = constant(shared, np.array(1, np.int64), "kvforge_alibi_one")
    scalar = constant(shared, np.array([], np.int64), "kvforge_alibi_scalar")
    seq = shared.op("Reshape", [shared.op("Shape", [ids], attributes={"start": 1, "end": 2}), scalar])
    starts = shared.op("Unsqueeze", [shared.op("Cast", [past_lens], attributes={"to": ir.DataType.INT64}),
                                     constant(shared, np.array([1], np.int64), "kvforge_alibi_axis1")])
    positions = shared.op("Add", [starts, shared.op("Range", [zero, seq, one])])  # [B, S]
    query_pos = shared.op("Unsqueeze", [positions, constant(shared, np.array([1, 3], np.int64), "kvforge_alibi_axes13")])
    total = shared.op("Reshape", [shared.op("Cast", [total_len], attributes={"to": ir.DataType.INT64}), scalar])
    return query_pos, shared.op("Range", [zero, total, one])


def _attention_bias(tape: ir.tape.Tape, node: ir.Node, heads: int, dtype: ir.DataType | None,
                    alibi_positions: tuple[ir.Value, ir.Value] | None, total_len: ir.Value,
                    shared: dict[object, ir.Value]) -> ir.Value | None:
    """GQA's attention_bias for the node, whose last dim is total_sequence_length (the capacity in decode.onnx, the
    longest row after this call in prefill): ALiBi's from the slopes, or the first total_len columns of the node's
    `attention_bias` [B|1, H, S, C]; each shared by the layers that read the same slopes or bias."""
    slopes, bias = alibi_input(node), bias_input(node)
    if slopes is not None and bias is not None:
        raise ExportError(f"attention node {node.name} has both ALiBi slopes and an attention bias, which the `ort` "
                          "target does not combine")
    if slopes is not None and alibi_positions is not None:
        if shared_key(slopes) not in shared:
            shared[shared_key(slopes)] = alibi_bias(tape, slopes, *alibi_positions, heads, dtype)
        return shared[shared_key(slopes)]
    if bias is None:
        return None
    if id(bias) not in shared:
        ends = tape.op("Cast", [tape.op("Reshape", [total_len, constant(tape, np.array([1], np.int64), None)])],
                       attributes={"to": ir.DataType.INT64})
        shared[id(bias)] = tape.op("Slice", [bias, constant(tape, np.array([0], np.int64), None), ends,
                                             constant(tape, np.array([3], np.int64), None)])
    return shared[id(bias)]


def _operands(tape: ir.tape.Tape, q: ir.Value, k: ir.Value, v: ir.Value,
              caches: list[ir.Value] | None) -> tuple[ir.Value, ir.Value | None, ir.Value | None, list[ir.Value | None]]:
    """q, k, v as GQA takes them, with its cos/sin inputs: RoPE applied right before attention folds in
    (q and k from before the rotation, the caches given), and q/k/v that are the three parts of one
    MatMul pass packed ([B, S, (H + 2 Hkv) * D], k and v None)."""
    pre_q, pre_k = (pre_rotary(q), pre_rotary(k)) if caches is not None else (None, None)
    if pre_q is None or pre_k is None:
        return q, k, v, [None, None]
    flat = constant(tape, np.array([0, 0, -1], np.int64), None)
    q = tape.op("Reshape", [pre_q[0], flat])
    k = tape.op("Reshape", [pre_k[0], flat])
    parts = [split_output(value) for value in (q, k, v)]
    if all(parts) and len({id(p[0]) for p in parts}) == 1 and [p[1] for p in parts] == [0, 1, 2] \
            and len(parts[0][0].outputs) == 3:
        return parts[0][0].inputs[0], None, None, list(caches)
    return q, k, v, list(caches)


def lower_moe(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    # Imported when an export lowers, not with the target registry (it brings in exporter/quantization).
    from kvforge.exporter.targets import moe_ort

    return moe_ort.lower_moe_to_ort(graph, quantize)


TARGET = ExportTarget(TARGETS["ort"], lower_to_ort, lower_moe, ort_fusions=True, quantize=True,
                      kv_cache_dtypes=("int8",), head_dim_multiple=8,  # GroupQueryAttention's head sizes
                      merge_pairs_dtypes=("fp16", "bf16"))
