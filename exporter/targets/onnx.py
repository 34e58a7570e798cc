"""The `onnx` target: standard ONNX Attention (opset 24) per layer, with TensorScatter writing the new rows
into the cache in place: the portable form that TensorRT (>= 10.15) also imports."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.core.errors import ExportError
from kvforge.core.targets import TARGETS
from kvforge.exporter.graph_edit import attention_inputs, constant, node_attributes, replace_node
from kvforge.exporter.image_blocks import block_ids_input, same_block_mask
from kvforge.exporter.targets.base import ExportTarget, alibi_bias, alibi_input, bias_input, shared_key


def lower_to_onnx(graph: ir.Graph, canonical: list[ir.Node], rotary: object = None, kv_scales: object = None) -> None:
    if graph.opset_imports.get("", 0) < 24:
        raise ExportError("the `onnx` target needs the graph exported at opset >= 24 (Attention + TensorScatter)")
    first = canonical[0]
    shared = ir.tape.Tape()
    write_index, query_pos, cache_pos, causal, attended = _positions(shared, first)
    graph.insert_before(first, shared.nodes)

    masks: dict[int, ir.Value] = {0: causal}
    sink_masks: dict[int, ir.Value] = {}
    alibi_masks: dict[tuple[int, object], ir.Value] = {}
    for node in canonical:
        attrs = node_attributes(node)
        (q, k, v, past_key, past_value, _), sinks = attention_inputs(node)
        heads, kv_heads, window = attrs["num_heads"], attrs["kv_num_heads"], attrs["sliding_window"]
        tape = ir.tape.Tape()
        if window not in masks:
            lower = tape.op("Sub", [query_pos, constant(tape, np.array(window, np.int64), f"kvforge_window{window}")])
            masks[window] = tape.op("And", [causal, tape.op("Greater", [cache_pos, lower])])

        def heads_first(x: ir.Value, n: int, tape: ir.tape.Tape = tape) -> ir.Value:
            shape = constant(tape, np.array([0, 0, n, -1], np.int64), None)
            return tape.op("Transpose", [tape.op("Reshape", [x, shape])], attributes={"perm": [0, 2, 1, 3]})

        present_key = tape.op("TensorScatter", [past_key, heads_first(k, kv_heads), write_index], attributes={"axis": 2})
        present_value = tape.op(
            "TensorScatter", [past_value, heads_first(v, kv_heads), write_index], attributes={"axis": 2}
        )
        attention = {"scale": attrs["scale"]}
        if attrs["softcap"] > 0:
            attention["softcap"] = attrs["softcap"]
        keys, values, mask = present_key, present_value, masks[window]
        if attended is not None:  # the positions written so far (_positions)
            keys, values = (tape.op("Slice", [x, constant(tape, np.array([0], np.int64), None), attended,
                                              constant(tape, np.array([2], np.int64), None)]) for x in (keys, values))
        slopes = alibi_input(node)
        if slopes is not None:
            if sinks is not None:
                raise ExportError(f"attention node {node.name} has both sinks and ALiBi slopes, which the `onnx` "
                                  "target does not combine")
            # ALiBi rides on Attention's additive mask: the bias where the causal mask allows, the lowest finite
            # value elsewhere, [B, H, S, C]; one per window and distinct slopes, shared by the layers.
            key = (window, shared_key(slopes))
            if key not in alibi_masks:
                np_dtype = q.dtype.numpy() if q.dtype is not None else np.float32
                bias = alibi_bias(tape, slopes, query_pos, cache_pos, heads, q.dtype)
                alibi_masks[key] = tape.op("Where", [mask, bias, constant(tape, np.array(np.finfo(np_dtype).min,
                                                                                         np_dtype), None)])
            mask = alibi_masks[key]
        if bias_input(node) is not None:
            if sinks is not None:
                raise ExportError(f"attention node {node.name} has both sinks and an attention bias, which the "
                                  "`onnx` target does not combine")
            mask = _biased_mask(tape, bias_input(node), mask, attended, q.dtype, alibi_masks, window, slopes)
        if sinks is not None:
            if attrs["softcap"] > 0:
                raise ExportError(f"attention node {node.name} has both sinks and a softcap; the `onnx` target's "
                                  "Attention would cap the sink too")
            keys, values, mask = _with_sink_column(tape, keys, values, mask, sinks, query_pos, heads,
                                                   q.dtype, sink_masks, window)
        y = tape.op("Attention", [heads_first(q, heads), keys, values, mask], attributes=attention)
        out = tape.op(
            "Reshape",
            [
                tape.op("Transpose", [y], attributes={"perm": [0, 2, 1, 3]}),
                constant(tape, np.array([0, 0, -1], np.int64), None),
            ],
        )
        replace_node(graph, node, tape, [out, present_key, present_value])


def _positions(shared: ir.tape.Tape, first: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value | None]:
    """Built once for every layer: the write index past_lens [B] (int64), the query positions [B, 1, S, 1], the key
    positions [C] and the mask [B, 1, S, C] of causal attention; and with image blocks (exporter/image_blocks.py), the
    attended length T = max(past_lens) + S: keys, positions and mask then cover the T positions written so far, not
    the whole capacity (prefill attends S x T scores, not S x C), and the mask adds each token's own block."""
    q0, past_key0, past_lens = first.inputs[0], first.inputs[3], first.inputs[5]
    zero = constant(shared, np.array(0, np.int64), "kvforge_zero")
    one = constant(shared, np.array(1, np.int64), "kvforge_one")
    seq = shared.op("Squeeze", [shared.op("Shape", [q0], attributes={"start": 1, "end": 2})])
    capacity = shared.op("Squeeze", [shared.op("Shape", [past_key0], attributes={"start": 2, "end": 3})])
    write_index = shared.op("Cast", [past_lens], attributes={"to": ir.DataType.INT64})  # [B]
    block_ids = block_ids_input(first)
    if block_ids is not None:
        capacity = shared.op("Add", [shared.op("ReduceMax", [write_index], attributes={"keepdims": 0}), seq])
    # positions[b, t] = past_lens[b] + t ; cache_pos[c] = c
    positions = shared.op(
        "Add",
        [
            shared.op("Unsqueeze", [write_index, constant(shared, np.array([1], np.int64), "kvforge_axis1")]),
            shared.op("Range", [zero, seq, one]),
        ],
    )
    query_pos = shared.op("Unsqueeze", [positions, constant(shared, np.array([1, 3], np.int64), "kvforge_axes13")])
    cache_pos = shared.op("Range", [zero, capacity, one])  # broadcasts as [1, 1, 1, C]
    causal = shared.op("LessOrEqual", [cache_pos, query_pos])  # [B, 1, S, C]
    if block_ids is None:
        return write_index, query_pos, cache_pos, causal, None
    causal = shared.op("Or", [causal, same_block_mask(shared, block_ids, past_lens, cache_pos)])
    return write_index, query_pos, cache_pos, causal, shared.op("Unsqueeze", [capacity, constant(shared, np.array(
        [0], np.int64), None)])


def _biased_mask(tape: ir.tape.Tape, bias: ir.Value, mask: ir.Value, attended: ir.Value | None,
                 dtype: ir.DataType | None, shared: dict, window: int, slopes: ir.Value | None) -> ir.Value:
    """The node's `attention_bias` [B|1, H, S, C] on Attention's additive mask: the bias where `mask` allows, the
    lowest finite value elsewhere (over the attended positions only, with image blocks); one per window and bias."""
    if slopes is not None:
        raise ExportError("an attention node has both ALiBi slopes and an attention bias, which the `onnx` target "
                          "does not combine")
    key = (window, id(bias))
    if key not in shared:
        np_dtype = dtype.numpy() if dtype is not None else np.float32
        if attended is not None:
            bias = tape.op("Slice", [bias, constant(tape, np.array([0], np.int64), None), attended,
                                     constant(tape, np.array([3], np.int64), None)])
        shared[key] = tape.op("Where", [mask, bias, constant(tape, np.array(np.finfo(np_dtype).min, np_dtype), None)])
    return shared[key]


def _with_sink_column(tape: ir.tape.Tape, present_key: ir.Value, present_value: ir.Value, mask: ir.Value,
                      sinks: ir.Value, query_pos: ir.Value, heads: int, dtype: ir.DataType | None,
                      float_masks: dict[int, ir.Value], window: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """ONNX Attention has no sinks: give it one more cache column whose key and value are zero, so its
    score is 0, and an additive mask whose last column is the head's sink logit. The softmax then
    includes exp(sink) and the extra value adds nothing, which is the sink's definition. The column
    costs a copy of the layer's cache per call; the `ort` target passes sinks to GQA instead."""
    np_dtype = dtype.numpy() if dtype is not None else np.float32
    if window not in float_masks:  # [B, H, S, C]: 0 where allowed, the lowest finite value elsewhere
        blocked = tape.op("Where", [mask, constant(tape, np.array(0, np_dtype), None),
                                    constant(tape, np.array(np.finfo(np_dtype).min, np_dtype), None)])
        float_masks[window] = tape.op("Expand", [blocked, constant(tape, np.array([1, heads, 1, 1], np.int64), None)])
    head_sinks = tape.op("Reshape", [sinks, constant(tape, np.array([1, heads, 1, 1], np.int64), None)])
    sink_column = tape.op("Expand", [head_sinks, tape.op("Shape", [query_pos])])  # [B, H, S, 1]
    float_mask = tape.op("Concat", [float_masks[window], sink_column], attributes={"axis": 3})
    cache_shape = tape.op("Shape", [present_key])
    row_shape = tape.op("Concat", [tape.op("Slice", [cache_shape, constant(tape, np.array([0], np.int64), None),
                                                      constant(tape, np.array([2], np.int64), None)]),
                                   constant(tape, np.array([1], np.int64), None),
                                   tape.op("Slice", [cache_shape, constant(tape, np.array([3], np.int64), None),
                                                      constant(tape, np.array([4], np.int64), None)])],
                        attributes={"axis": 0})
    zero_row = tape.op("ConstantOfShape", [row_shape], attributes={"value": ir.tensor(np.zeros(1, np_dtype))})
    keys = tape.op("Concat", [present_key, zero_row], attributes={"axis": 2})
    values = tape.op("Concat", [present_value, zero_row], attributes={"axis": 2})
    return keys, values, float_mask



def lower_moe(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    # Imported when an export lowers, not with the target registry (it brings in exporter/quantization).
    from kvforge.exporter.targets import moe_plain

    return moe_plain.lower_moe_to_plain(graph, quantize)


TARGET = ExportTarget(TARGETS["onnx"], lower_to_onnx, lower_moe)
