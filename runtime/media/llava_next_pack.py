"""LLaVA-NeXT's and LLaVA-OneVision's arrangement of an image's tile features (the models' pack_image_features), in
numpy: vision.onnx gives the features of the image's tiles as the tiling made them (tiles_llava_next.py: the base
tile, then the grid row by row) and the model's image_newline; the runtime lays them out by the image's size.

transformers 5.24, models/llava_next/modeling_llava_next.py LlavaNextModel.pack_image_features and
models/llava_onevision/modeling_llava_onevision.py LlavaOnevisionModel.pack_image_features:
- one tile (OneVision's image of a prompt with several): its features, then image_newline;
- else the base tile's features, then the grid's: the tiles' patch squares joined into one map of the grid's
  shape, the rows (or columns) of padding the processor centred the image on taken off, OneVision's map pooled
  bilinearly where it is over 1.1 times its anyres_max_N budget, and image_newline after each row of the map.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.tile_ops import TiledImage
from kvforge.runtime.media.tiles_llava_next import _most_tiles, llava_next_image


def _tile_square(features: np.ndarray, tiles: int) -> int:
    """The patches along a tile's side: each tile's features are a square of them (the pack's view)."""
    if tiles < 1 or features.ndim != 2 or features.shape[0] % tiles:
        raise InputError(f"the vision graph gave features of shape {list(features.shape)} for {tiles} tiles; "
                         "re-run the export")
    side = math.isqrt(features.shape[0] // tiles)
    if side * side != features.shape[0] // tiles:
        raise InputError(f"the vision graph gives {features.shape[0] // tiles} features a tile, not a square of "
                         "patches as LLaVA-NeXT's pack needs; re-run the export")
    return side


def unpad(grid: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[H', W', hidden]: the [H, W, hidden] map of the grid with the padding rows or columns off, as the model's
    unpad_image computes them from the original (height, width)."""
    height, width = size
    current_h, current_w = grid.shape[:2]
    if width / height > current_w / current_h:
        new_h = int(round(height * (current_w / width), 7))
        pad = (current_h - new_h) // 2
        return grid[pad:current_h - pad]
    new_w = int(round(width * (current_h / height), 7))
    pad = (current_w - new_w) // 2
    return grid[:, pad:current_w - pad]


def _source(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(low index, high index, low weight, high weight) per output row of torch's CPU bilinear resize
    (align_corners=False, no antialias), its weights to the bit: source = (i + 0.5) * scale - 0.5 in one rounding
    (a fused multiply-add) with scale = in / out in float32, clamped at 0; weights in float32."""
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    source = ((np.arange(out_size, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    source = np.maximum(source, np.float32(0.0))
    low = np.minimum(np.floor(source).astype(np.int64), in_size - 1)
    high = np.minimum(low + 1, in_size - 1)
    weight = source - low.astype(np.float32)
    return low, high, np.float32(1.0) - weight, weight


def bilinear(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """[height, width, hidden]: `grid` [H, W, hidden] resized as torch.nn.functional.interpolate(mode="bilinear")
    does on CPU: torch's weights, the sums in float64 rounded once (within an ulp or two of torch's float32 sums)."""
    if height < 1 or width < 1:
        raise InputError(f"LLaVA-OneVision's pooled feature map would be {height}x{width}; send a less elongated "
                         "image")
    low_h, high_h, *by_h = _source(height, grid.shape[0])
    low_w, high_w, *by_w = _source(width, grid.shape[1])
    w0_h, w1_h = (w.astype(np.float64)[:, None, None] for w in by_h)
    w0_w, w1_w = (w.astype(np.float64)[None, :, None] for w in by_w)
    work = grid.astype(np.float64)
    rows = work[low_h] * w0_h + work[high_h] * w1_h
    out = rows[:, low_w] * w0_w + rows[:, high_w] * w1_w
    return out.astype(grid.dtype)


def _pooled(grid: np.ndarray, side: int, aspect: Any) -> np.ndarray:
    """OneVision's map pooled to about anyres_max_N tiles' worth of features where it is over 1.1 times that."""
    height, width = grid.shape[:2]
    ratio = math.sqrt(height * width / (_most_tiles(aspect) * side**2))
    if ratio <= 1.1:
        return grid
    return bilinear(grid, int(height // ratio), int(width // ratio))


def _pack(features: np.ndarray, tiled: TiledImage, extras: list[np.ndarray], aspect: Any) -> np.ndarray:
    """The pack of both families; aspect: OneVision's vision_aspect_ratio, None for LLaVA-NeXT (no pooling)."""
    if len(extras) != 1 or np.shape(extras[0]) != (features.shape[-1],):
        raise InputError("the vision graph gives no image_newline of the features' width; re-run the export")
    newline = np.asarray(extras[0], dtype=features.dtype)
    tiles = len(tiled.tiles)
    side = _tile_square(features, tiles)
    per_tile = features.reshape(tiles, side * side, -1)
    if tiles == 1:
        return np.concatenate([per_tile[0], newline[None]], 0)
    if tiled.rows * tiled.cols != tiles - 1 or tiled.size is None:
        raise InputError(f"an image of {tiles} tiles has a {tiled.rows}x{tiled.cols} grid; re-run the export")
    hidden = features.shape[-1]
    grid = per_tile[1:].reshape(tiled.rows, tiled.cols, side, side, hidden)
    grid = grid.transpose(0, 2, 1, 3, 4).reshape(tiled.rows * side, tiled.cols * side, hidden)
    grid = unpad(grid, tiled.size)
    if aspect is not None:
        grid = _pooled(grid, side, aspect)
    lines = np.broadcast_to(newline, (grid.shape[0], 1, hidden))
    rows = np.concatenate([grid, lines], 1).reshape(-1, hidden)
    return np.concatenate([per_tile[0], rows], 0)


def pack_llava_next(features: np.ndarray, tiled: TiledImage, vision_record: dict[str, Any],
                    extras: list[np.ndarray]) -> np.ndarray:
    """[tokens, hidden]: LlavaNextModel.pack_image_features of one image's tile features [tiles * T, hidden]
    (extras: [image_newline [hidden]]); tokens is tiled.image_tokens."""
    return _pack(np.asarray(features), tiled, extras, None)


def pack_llava_onevision(features: np.ndarray, tiled: TiledImage, vision_record: dict[str, Any],
                         extras: list[np.ndarray]) -> np.ndarray:
    """[tokens, hidden]: LlavaOnevisionModel.pack_image_features of one image's tile features, pooled by the
    record's prompt setting vision_aspect_ratio ("anyres_max_N"), as the processor counted its tokens."""
    aspect = (vision_record.get("prompt") or {}).get("vision_aspect_ratio", "anyres_max_9")
    return _pack(np.asarray(features), tiled, extras, aspect)


def llava_onevision_image(image: Any, record: dict[str, Any], prompt: dict[str, Any],
                          whole: bool = False) -> TiledImage:
    """OneVision's tiling (runtime/media/tiling.py TILINGS): LlavaOnevisionImageProcessor's tiles and
    LlavaOnevisionProcessor's text; whole: the image is one of several in its prompt (one padded tile)."""
    return llava_next_image(image, record, prompt, onevision=True, whole=whole)
