"""The canonical graphs: one dynamo trace of the prefill graph, and the decode graph derived from it.

The model runs inside GraphWrapper (exporter/wrapper.py), which routes attention through the kvforge
op; the graph's inputs and outputs are named by the contract (kvforge/core/contract.py).
"""

from __future__ import annotations

import contextlib
import io as io_module
import warnings
from typing import Any

import numpy as np

from kvforge.core.contract import (
    IMAGE_FEATURES,
    INPUT_IDS,
    KV_KINDS,
    LOGITS,
    LOGITS_INDEX,
    LOGITS_POSITIONS,
    PAST_LENS,
    POSITION_IDS,
    ROPE_DELTAS,
    GraphIO,
    KVLayout,
)
from kvforge.core.progress import quiet_logger

OPSET = 24
# Example sizes for tracing; every one of these dimensions is dynamic in the graphs.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_CAPACITY = 2, 8, 32


def trace_prefill(model: Any, layout: KVLayout, torch_dtype: Any, family: Any = None, fake_mode: Any = None,
                  image_token_id: int | None = None, aux_layers: tuple[int, ...] | None = None,
                  mrope: bool = False, deepstack: int = 0) -> Any:
    """The canonical prefill graph (an onnx_ir model): attention as one kvforge node per layer, every
    batch, sequence, position and capacity dimension dynamic, IO named by the contract. `image_token_id`: a
    vision-language export's, whose prefill also takes the image tokens' features (contract.IMAGE_FEATURES).
    `aux_layers`: a speculation head's, whose graphs also output those layers' inputs (contract.TARGET_HIDDEN).
    `mrope`: a prefill that takes multimodal positions (contract.POSITION_IDS; derive_decode_graph makes decode's).
    `deepstack`: text layers that add an image token's further features (its IMAGE_FEATURES row is that much wider)."""
    import torch
    from torch.export import Dim

    from kvforge.exporter.recurrent import traceable_recurrences
    from kvforge.exporter.wrapper import GraphWrapper
    from kvforge.plugins.moe_op import CUSTOM_TRANSLATION_TABLE as MOE_TRANSLATION
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    batch_dim, seq_dim, capacity_dim, k_dim = Dim("batch"), Dim("seq"), Dim("capacity"), Dim("positions")
    seq, b = _EXAMPLE_SEQ, _EXAMPLE_BATCH
    cache = [torch.zeros(layout.buffer_shape(b, _EXAMPLE_CAPACITY, layer, kind),
                         dtype=_torch_dtype(layout.buffer_dtype(layer, kind), torch_dtype)) for layer, kind in layout.buffers()]
    args: list[torch.Tensor] = [torch.ones(b, seq, dtype=torch.int64), torch.zeros(b, dtype=torch.int32)]
    # Two positions per row in the example, so the positions dimension stays dynamic.
    args.append(torch.tensor([[seq - 2, seq - 1]] * b, dtype=torch.int64))
    # KV buffers: batch and capacity dynamic; a recurrent state's size per row is fixed.
    rest_shapes: list[dict] = [{0: batch_dim, 1: k_dim}] + [
        {0: batch_dim, 2: capacity_dim} if kind in KV_KINDS else {0: batch_dim} for _, kind in layout.buffers()]
    if image_token_id is not None:
        hidden = model.get_input_embeddings().weight.shape[-1]
        args.append(torch.zeros(3, hidden * (1 + deepstack), dtype=torch_dtype))
        rest_shapes.insert(1, {0: Dim("image_tokens")})
    if mrope:
        args.append(torch.arange(seq, dtype=torch.int64).expand(3, b, seq).contiguous())
        rest_shapes.insert(2 if image_token_id is not None else 1, {1: batch_dim, 2: seq_dim})
    io = GraphIO.of("prefill", layout, images=image_token_id is not None, hidden=aux_layers is not None, mrope=mrope)
    if fake_mode is not None:  # the model's weights are fake tensors of this mode: the inputs must be too
        args, cache = [fake_mode.from_tensor(a) for a in args], [fake_mode.from_tensor(c) for c in cache]
    # torch.onnx prints its steps to stdout and warns about torchvision; keep stdout for --json.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"), \
            traceable_recurrences(model):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            GraphWrapper(model, "prefill", family, layout, image_token_id, aux_layers, mrope, deepstack),
            tuple(args + cache),
            dynamo=True,
            input_names=list(io.inputs),
            output_names=list(io.outputs),
            dynamic_shapes=({0: batch_dim, 1: seq_dim}, {0: batch_dim}, tuple(rest_shapes)),
            custom_translation_table={**CUSTOM_TRANSLATION_TABLE, **MOE_TRANSLATION},
            opset_version=OPSET,
            optimize=False,  # optimize_graph() below does the part of it these graphs need, 5x faster
            verbose=False,
        )
    return program.model


def _torch_dtype(name: str, default: Any) -> Any:
    """The torch dtype of a cache buffer's dtype name (the KV cache's is the export's)."""
    import torch

    return getattr(torch, name) if name in ("float32", "float16", "bfloat16") else default


def derive_decode_graph(prefill: Any) -> Any:
    """decode.onnx from the canonical prefill graph, without a second trace: the same graph with
    input_ids [B, 1], no `logits_index` input (the one new position is the only one: the gather
    that picks positions is dropped, its [B, 1, H] input is its output) and logits [B, 1, V]
    squeezed to [B, V]. The clone shares the weight tensors."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes

    from kvforge.exporter.image_blocks import drop_block_ids

    model = prefill.clone()
    graph = model.graph
    by_name = {value.name: value for value in graph.inputs}
    if IMAGE_FEATURES in by_name:
        _drop_image_features(graph, by_name[IMAGE_FEATURES])
    if POSITION_IDS in by_name:
        _positions_from_deltas(graph, by_name[POSITION_IDS], by_name[PAST_LENS])
    index, ids = by_name[LOGITS_INDEX], by_name[INPUT_IDS]
    gather = _positions_gather(index)
    gather.outputs[0].replace_all_uses_with(gather.inputs[0])
    graph.inputs.remove(index)
    drop_block_ids(graph)  # one new token: causal (exporter/image_blocks.py)
    passes.RemoveUnusedNodesPass()(model)  # the gather and the index's Unsqueeze / Expand
    ids.shape = ir.Shape([ids.shape[0], 1])
    position = next(i for i, value in enumerate(graph.outputs) if value.name == LOGITS)
    per_position = graph.outputs[position]
    per_position.name = LOGITS_POSITIONS
    squeeze = ir.tape.Tape()
    one = squeeze.op("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64), name="kvforge_one_d")})
    logits = squeeze.op("Squeeze", [per_position, one], output=ir.Value(name=LOGITS))
    graph.extend(squeeze.nodes)
    logits.dtype, logits.shape = per_position.dtype, ir.Shape([per_position.shape[0], per_position.shape[2]])
    graph.outputs[position] = logits
    return model


def _drop_image_features(graph: Any, features: Any) -> None:
    """Decode takes no images: the Where that writes the image features over the image tokens' embeddings
    (wrapper.merge_image_features) passes the text embeddings on, and the features input goes (its nodes go with
    the unused-node pass that follows)."""
    frontier, seen = [features], set()
    while frontier:
        value = frontier.pop()
        for node, slot in value.uses():
            if node.op_type == "Where" and slot == 1:
                node.outputs[0].replace_all_uses_with(node.inputs[2])
                graph.remove(node, safe=True)
                _no_features(graph, features)
                graph.inputs.remove(features)
                return
            if id(node) not in seen:
                seen.add(id(node))
                frontier.extend(node.outputs)
    raise RuntimeError("the prefill graph has no Where fed by image_features: wrapper.merge_image_features changed")


def _positions_from_deltas(graph: Any, positions: Any, past_lens: Any) -> None:
    """An M-RoPE decode's positions (contract.ROPE_DELTAS): the new token's three positions are
    past_lens[b] + rope_deltas[b], [3, B, 1], in place of the prefill's position_ids input."""
    import onnx_ir as ir

    deltas = ir.Value(name=ROPE_DELTAS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([past_lens.shape[0]]))
    tape = ir.tape.Tape()
    lens = tape.op("Cast", [past_lens], attributes={"to": ir.DataType.INT64})
    row = tape.op("Add", [lens, deltas])
    axes = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([0, 2], np.int64), name="kvforge_axes_0_2")})
    three = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([3, 1, 1], np.int64), name="kvforge_3_1_1")})
    streams = tape.op("Expand", [tape.op("Unsqueeze", [row, axes]), three])  # [3, B, 1]: the three streams equal
    positions.replace_all_uses_with(streams)
    graph.insert_before(graph.node(0), tape.nodes)
    graph.inputs[graph.inputs.index(positions)] = deltas


def _no_features(graph: Any, features: Any) -> None:
    """What else reads the image features (Qwen3-VL's DeepStack additions) reads none: [0, width] (its gathers then
    add nothing, as for a prefill without images)."""
    import onnx_ir as ir

    if not _read_by_live_nodes(graph, features):  # only the merge's nodes, which the unused-node pass removes
        return
    width = features.shape[1]
    tape = ir.tape.Tape()
    empty = tape.op("Constant", [], attributes={"value": ir.tensor(
        np.zeros((0, int(width)), dtype=features.dtype.numpy()), name="kvforge_no_image_features")})
    features.replace_all_uses_with(empty)
    graph.insert_before(graph.node(0), tape.nodes)


def _read_by_live_nodes(graph: Any, value: Any) -> bool:
    """Whether a node that some graph output depends on reads `value`."""
    live: set[int] = set()
    stack = [out.producer() for out in graph.outputs if out.producer() is not None]
    while stack:
        node = stack.pop()
        if id(node) not in live:
            live.add(id(node))
            stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return any(id(node) in live for node, _ in value.uses())


def _positions_gather(index: Any) -> Any:
    """The GatherElements (axis 1) that picks the hidden states at `logits_index`, reached from the
    index through its Unsqueeze / Expand (GraphWrapper's torch.gather)."""
    frontier, seen = [index], 0
    while frontier and seen < 8:
        value = frontier.pop()
        for node, slot in value.uses():
            if node.op_type == "GatherElements" and slot == 1:
                return node
            if node.op_type in ("Unsqueeze", "Expand", "Cast"):
                frontier.extend(node.outputs)
        seen += 1
    raise RuntimeError("the prefill graph has no GatherElements fed by logits_index: GraphWrapper's gather changed")
