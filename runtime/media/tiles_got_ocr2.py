"""GotOcr2ImageProcessor with crop_to_patches (InternVL, Aya Vision): the image resized to the grid of tiles whose
aspect ratio is nearest its own (min_patches..max_patches tiles), cut into tiles row by row, then a thumbnail of the
whole image when there is more than one tile; and the text InternVLProcessor / AyaVisionProcessor write for it.

transformers 5.24, models/got_ocr2/image_processing_pil_got_ocr2.py; models/internvl/processing_internvl.py;
models/aya_vision/processing_aya_vision.py. Both processors pass crop_to_patches=True to the image processor
whatever its own setting (their images_kwargs defaults), so `prompt["crop_to_patches"]` defaults to True here.

Record fields (the image processor as transformers resolves it): size {height, width}, resample, do_convert_rgb,
do_rescale, rescale_factor, do_normalize, image_mean, image_std, crop_to_patches, min_patches, max_patches.
Prompt fields (the Processor's): InternVL image_seq_length, start_image_token, end_image_token,
context_image_token (the tokenizer's <img>, </img>, <IMG_CONTEXT>); Aya Vision patch_size, img_size,
downsample_factor, start_of_img_token, end_of_img_token, img_patch_token, tile_token, tile_global_token.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.tile_ops import TiledImage, finish, positive, resample_of, resize, to_array

BICUBIC = 3


@lru_cache(maxsize=16)
def tile_arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows) of every grid with min_tiles..max_tiles tiles, fewest tiles first (a stable sort, as
    transformers' get_all_supported_aspect_ratios)."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if min_tiles <= w * h <= max_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def best_grid(height: int, width: int, tile: tuple[int, int], min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) nearest the image's aspect ratio; on a tie the later grid (more tiles) while the image's area
    is over half the grid's (transformers' get_optimal_tiled_canvas)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in tile_arrangements(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * grid[0] * grid[1]:
            best = grid
    return best


def _settings(record: dict[str, Any], crop_to_patches: bool | None) -> tuple[int, int, bool, int, int]:
    size = record.get("size") or {}
    if not {"height", "width"} <= set(size):
        raise InputError(f"GotOcr2ImageProcessor size {size!r} is not one kvforge's runtime reproduces (it takes "
                         "{height, width})")
    tile_h, tile_w = positive(record, "size.height", size["height"]), positive(record, "size.width", size["width"])
    crop = bool(record.get("crop_to_patches")) if crop_to_patches is None else crop_to_patches
    min_tiles = positive(record, "min_patches", record.get("min_patches", 1))
    max_tiles = positive(record, "max_patches", record.get("max_patches", 12))
    if max_tiles > 64:  # released checkpoints take 6..12; more is a damaged record, not an image to tile
        raise InputError(f"image processor record field max_patches is {max_tiles}; kvforge takes at most 64 tiles")
    return tile_h, tile_w, crop, min_tiles, max_tiles


def got_ocr2_tiles(image: Any, record: dict[str, Any],
                   crop_to_patches: bool | None = None) -> tuple[list[np.ndarray], int, int]:
    """(tiles, rows, columns): the image's tiles in the processor's order (row by row, then the thumbnail where
    there are several), each [3, size.height, size.width] float32. crop_to_patches None takes the record's."""
    tile_h, tile_w, crop, min_tiles, max_tiles = _settings(record, crop_to_patches)
    resample = resample_of(record, BICUBIC)
    array = to_array(image, bool(record.get("do_convert_rgb", True)))
    if not (crop and max_tiles > 1):
        if record.get("do_resize", True):
            array = resize(array, tile_h, tile_w, resample)
        return [finish(array, record)], 1, 1
    cols, rows = best_grid(array.shape[1], array.shape[2], (tile_h, tile_w), min_tiles, max_tiles)
    canvas = resize(array, tile_h * rows, tile_w * cols, resample)
    tiles = [canvas[:, r * tile_h:(r + 1) * tile_h, c * tile_w:(c + 1) * tile_w]
             for r in range(rows) for c in range(cols)]
    if len(tiles) != 1:
        tiles.append(resize(array, tile_h, tile_w, resample))
    return [finish(tile, record) for tile in tiles], rows, cols


def internvl_image(image: Any, record: dict[str, Any], prompt: dict[str, Any]) -> TiledImage:
    """The image's tiles and InternVLProcessor's text for it: <img>, image_seq_length context tokens a tile,
    </img>."""
    tiles, rows, cols = got_ocr2_tiles(image, record, prompt.get("crop_to_patches", True))
    count = positive(prompt, "image_seq_length", prompt.get("image_seq_length", 256)) * len(tiles)
    text = (prompt.get("start_image_token", "<img>") + prompt.get("context_image_token", "<IMG_CONTEXT>") * count
            + prompt.get("end_image_token", "</img>"))
    return TiledImage(tiles, rows, cols, text, count)


def aya_vision_image(image: Any, record: dict[str, Any], prompt: dict[str, Any]) -> TiledImage:
    """The image's tiles and AyaVisionProcessor's text for it: the start token, for each tile but the last
    `{tile_token}_{n}` (n from 1) and its patch tokens, the global tile token and the thumbnail's patch tokens, the
    end token. (The tile marker is the tile token followed by the text "_n", as transformers writes it.)"""
    tiles, rows, cols = got_ocr2_tiles(image, record, prompt.get("crop_to_patches", True))
    side = positive(prompt, "patch_size", prompt.get("patch_size", 28)) * positive(
        prompt, "downsample_factor", prompt.get("downsample_factor", 1))
    per_tile = (positive(prompt, "img_size", prompt.get("img_size", 364)) // side) ** 2
    patch = prompt.get("img_patch_token", "<|IMG_PATCH|>")
    tile_token = prompt.get("tile_token", "TILE")
    parts = [prompt.get("start_of_img_token", "<|START_OF_IMG|>")]
    parts += [f"{tile_token}_{n}" + patch * per_tile for n in range(1, len(tiles))]
    parts += [prompt.get("tile_global_token", "TILE_GLOBAL") + patch * per_tile,
              prompt.get("end_of_img_token", "<|END_OF_IMG|>")]
    return TiledImage(tiles, rows, cols, "".join(parts), per_tile * len(tiles))
