"""Image tokens that attend to each other both ways (Gemma 3): the fused op's `block_ids` input.

Within one image, Gemma 3's image tokens see each other in both directions in prefill (Hugging Face: token_type_ids
-> an or-mask over each image's block, inside the sliding window on sliding layers); everything else stays causal.
The prefill graph computes the block ids from its input_ids (each contiguous run of the image token is one block),
hands them to every layer's fused op (contract.ATTENTION_OPTIONAL_INPUTS) and the decode graph drops them (one new
token is a block of one: causal). Only a family whose VisionFamily row says so has them, so every other export's
graphs are as before. The runtime keeps each block inside one prefill call (runtime/drivers/image_blocks.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.core.contract import ATTENTION_INPUTS, ATTENTION_OPTIONAL_INPUTS

_BLOCK_SLOT = len(ATTENTION_INPUTS) + ATTENTION_OPTIONAL_INPUTS.index("block_ids")


def bidirectional_images(config: Any) -> bool:
    """Whether a text model's config comes from a vision-language checkpoint whose image tokens attend both ways."""
    from kvforge.exporter.text_model import text_of
    from kvforge.models.vision_families import vision_family

    source = text_of(config) or {}
    family = vision_family(source.get("model_type"))
    return family is not None and family.bidirectional_images


def block_ids_of(input_ids: Any, image_token_id: int) -> Any:
    """[B, S] int64: 0 for a text token, k > 0 for the tokens of the k-th contiguous run of image tokens in the row."""
    import torch

    image = input_ids == image_token_id
    previous = torch.nn.functional.pad(image, (1, 0), value=False)[:, :-1]
    starts = (image & ~previous).to(torch.int64)
    return torch.cumsum(starts, dim=1) * image.to(torch.int64)


def image_block_ids(wrapper: Any, input_ids: Any) -> Any:
    """The block ids a GraphWrapper's prefill hands the fused op: None unless it merges images (image_token_id) of a
    family whose image tokens attend both ways."""
    if wrapper.phase != "prefill" or wrapper.image_token_id is None or not bidirectional_images(wrapper.model.config):
        return None
    return block_ids_of(input_ids, wrapper.image_token_id)


def block_ids_input(node: ir.Node) -> ir.Value | None:
    """The canonical node's `block_ids` input, None when absent."""
    inputs = list(node.inputs)
    return inputs[_BLOCK_SLOT] if len(inputs) > _BLOCK_SLOT else None


def drop_block_ids(graph: ir.Graph) -> None:
    """The decode graph: one new token per row, a block of one, so the canonical nodes lose `block_ids` (and the
    unused-node pass that follows, its computation); the lowering then gives decode the causal op."""
    for node in graph:
        if block_ids_input(node) is None:
            continue
        node.replace_input_with(_BLOCK_SLOT, None)  # later optional inputs (attention_bias) keep their slots
        inputs = list(node.inputs)
        while len(inputs) > len(ATTENTION_INPUTS) and inputs[-1] is None:
            inputs.pop()
        node.resize_inputs(len(inputs))


def same_block_mask(tape: ir.tape.Tape, block_ids: ir.Value, past_lens: ir.Value, capacity_positions: ir.Value
                    ) -> ir.Value:
    """[B, 1, S, C] bool: whether cache position c holds a new token of new token t's image block (k > 0). The new
    tokens sit at past_lens[b] + 0..S-1 (`capacity_positions`: 0..C-1 int64); earlier positions are in no block."""
    def const(value: Any) -> ir.Value:
        return tape.op("Constant", [], attributes={"value": ir.tensor(np.array(value, np.int64))})

    starts = tape.op("Unsqueeze", [tape.op("Cast", [past_lens], attributes={"to": ir.DataType.INT64}), const([1])])
    offset = tape.op("Sub", [tape.op("Unsqueeze", [capacity_positions, const([0])]), starts])  # [B, C]
    seq = tape.op("Squeeze", [tape.op("Shape", [block_ids], attributes={"start": 1, "end": 2}), const([0])])
    last = tape.op("Sub", [seq, const(1)])
    inside = tape.op("And", [tape.op("GreaterOrEqual", [offset, const(0)]), tape.op("Less", [offset, seq])])
    index = tape.op("Max", [tape.op("Min", [offset, last]), const(0)])
    gathered = tape.op("GatherElements", [block_ids, index], attributes={"axis": 1})
    key_block = tape.op("Where", [inside, gathered, const(0)])  # [B, C]
    query_block = tape.op("Unsqueeze", [block_ids, const([2])])  # [B, S, 1]
    same = tape.op("And", [tape.op("Equal", [query_block, tape.op("Unsqueeze", [key_block, const([1])])]),
                           tape.op("Greater", [query_block, const(0)])])  # [B, S, C]
    return tape.op("Unsqueeze", [same, const([1])])
