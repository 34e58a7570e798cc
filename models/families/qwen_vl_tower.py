"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL image towers as one traceable module (exporter/vision_patches.py).

These towers take each image at its own size: `pixel_values` [patches, C*T*P*P] and `grid_thw` [images, 3]. HF's
forward derives the rotary positions, the attention segments (`cu_seqlens`), Qwen2.5's window order and Qwen3's
position-grid resampling from grid_thw in data-dependent Python, and its eager attention splits the patches with
`lengths.tolist()`: neither traces with a dynamic patch count. HF's helpers (transformers.vision_utils) also take
those arrays precomputed, through the tower's kwargs, so the graph takes them as inputs (the runtime computes them
in numpy from grid_thw) and HF's own tower runs on them; while tracing, each attention module attends over the
whole patch sequence with a block-diagonal mask (segment ids from cu_seqlens: images, or Qwen2.5's windows) instead
of one call per segment.
"""

from __future__ import annotations

import sys
from typing import Any

from kvforge.models.families.surgery import Patches

# The arrays the graph takes after pixel_values, per family, named as HF's helpers' kwargs (each exactly what the
# helper computes from grid_thw; see tower_inputs).
TOWER_INPUTS: dict[str, tuple[str, ...]] = {
    "qwen2_vl": ("position_ids", "cu_seqlens"),
    "qwen2_5_vl": ("position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"),
    "qwen3_vl": ("position_ids", "cu_seqlens", "interp_indices", "interp_weights"),
}
# Qwen3-VL's DeepStack mergers' features (one [tokens, hidden] per layer of deepstack_visual_indexes), which its text
# model adds to the image tokens' hidden states after its first layers, ride in each image token's features row:
# [tokens, hidden * (1 + layers)] (the prefill graph splits them; models/families/qwen_vl.py).
MASKED = "vision attention over the whole patch sequence with a block-diagonal mask from cu_seqlens (traceable)"


def tower_inputs(model: Any, grid_thw: Any) -> dict[str, Any]:
    """The graph's inputs after pixel_values for images of grid `grid_thw` [images, 3], as transformers' own
    helpers compute them inside the tower (the reference the runtime's numpy version must equal)."""
    from transformers import vision_utils as helpers

    visual = model.model.visual
    config = visual.config
    merge = config.spatial_merge_size
    inputs = {"position_ids": helpers.get_vision_position_ids(grid_thw, merge),
              "cu_seqlens": helpers.get_vision_cu_seqlens(grid_thw)}
    names = TOWER_INPUTS[model.config.model_type]
    if "window_index" in names:
        inputs["window_index"], inputs["cu_window_seqlens"] = helpers.get_vision_window_index(
            grid_thw, merge, config.window_size, config.patch_size)
    if "interp_indices" in names:
        inputs["interp_indices"], inputs["interp_weights"] = helpers.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    return inputs


def segment_ids(cu_seqlens: Any, length: Any) -> Any:
    """[length] int64: the index of the segment (cu_seqlens' run) each position falls in."""
    import torch

    positions = torch.arange(length, device=cu_seqlens.device)
    return (positions[:, None] >= cu_seqlens[None, 1:].to(torch.int64)).sum(-1)


def masked_attention_forward(self: Any, hidden_states: Any, cu_seqlens: Any, position_embeddings: Any = None,
                             **kwargs: Any) -> Any:
    """HF's Qwen vision attention (qkv, 2D rotary, softmax in float32, proj) with one masked softmax over all
    patches: a patch attends to the patches of its own cu_seqlens segment only, as HF's per-segment calls do."""
    import torch

    rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision  # the module's own HF function
    length = hidden_states.shape[0]
    query, key, value = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    query, key = rotary(query, key, cos, sin)
    query, key, value = (tensor.transpose(0, 1) for tensor in (query, key, value))  # [heads, length, head_dim]
    segments = segment_ids(cu_seqlens, length)
    same = segments[:, None] == segments[None, :]
    bias = torch.zeros(same.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~same, torch.finfo(query.dtype).min)
    weights = torch.matmul(query, key.transpose(1, 2)) * self.scaling + bias
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(0, 1).reshape(length, -1)
    return self.proj(out)


def mask_attention(visual: Any, patches: Patches) -> int:
    """Route every attention module of the tower through masked_attention_forward (undone when `patches` closes);
    the number of modules patched."""
    import types

    count = 0
    for block in visual.blocks:
        patches.set(block.attn, "forward", types.MethodType(masked_attention_forward, block.attn))
        count += 1
    return count


def tower_module(model: Any) -> Any:
    """A module: forward(pixel_values [patches, C*T*P*P], *TOWER_INPUTS[type]) -> image features
    [patches / merge^2, text hidden] (the images' tokens in order; Qwen3-VL: [tokens, hidden * (1 + DeepStack
    layers)]), computed by the checkpoint's own tower from the precomputed inputs."""
    import torch

    names = TOWER_INPUTS[model.config.model_type]

    class Tower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = model.model.visual

        def forward(self, pixel_values: Any, *inputs: Any) -> Any:
            kwargs = dict(zip(names, inputs, strict=True))
            out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=None, return_dict=True, **kwargs)
            deepstack = getattr(out, "deepstack_features", None)
            if deepstack:  # each token's row: its features, then its DeepStack layers' (one array, one IO name)
                return torch.cat([out.pooler_output, *deepstack], -1)
            return out.pooler_output

    return Tower().eval()
