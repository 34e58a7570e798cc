"""LlavaNextImageProcessor / LlavaOnevisionImageProcessor ("anyres"): the image resized into the best of
image_grid_pinpoints (aspect kept, centred on zeros), cut into crop-size tiles row by row, after the whole image
resized to one tile (the base image, first); each tile then resized to `size` and centre-cropped as the processor
does; and the image tokens LlavaNextProcessor / LlavaOnevisionProcessor write for it (with unpadding).

transformers 5.24, models/llava_next/image_processing_pil_llava_next.py, processing_llava_next.py;
models/llava_onevision/image_processing_pil_llava_onevision.py, processing_llava_onevision.py. LLaVA-OneVision
takes an image of a prompt with several images whole: padded to a square in image_mean x 255, one tile.

Record fields: do_convert_rgb, do_resize, size ({shortest_edge} or {height, width}), resample, do_center_crop,
crop_size, do_rescale, rescale_factor, do_normalize, image_mean, image_std, image_grid_pinpoints. (do_pad pads the
tile counts of a batch to the largest: nothing for one image.) Prompt fields (the Processor's): LLaVA-NeXT
patch_size, vision_feature_select_strategy, num_additional_image_tokens, image_token; LLaVA-OneVision
num_image_tokens, vision_feature_select_strategy, vision_aspect_ratio, image_token.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.tile_ops import (
    TiledImage,
    center_crop,
    finish,
    positive,
    resample_of,
    resize,
    resize_edge,
    to_array,
)

BICUBIC = 3


def select_best_resolution(height: int, width: int, pinpoints: list[list[int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` keeping most of the image's pixels, then wasting fewest (transformers'
    select_best_resolution)."""
    best, most, least_waste = None, 0, float("inf")
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = pin_w * pin_h - effective
        if effective > most or (effective == most and waste < least_waste):
            best, most, least_waste = (int(pin_h), int(pin_w)), effective, waste
    if best is None:
        raise InputError("image processor record field image_grid_pinpoints has no resolution; re-run the export")
    return best


def fit_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image scaled into `target`, aspect kept (transformers' get_patch_output_size)."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def _settings(record: dict[str, Any]) -> tuple[tuple[int, int], int, list[list[int]]]:
    """(base size, tile side, pinpoints) as the processor's _preprocess reads them."""
    size = record.get("size") or {}
    if {"height", "width"} <= set(size):
        base = (positive(record, "size.height", size["height"]), positive(record, "size.width", size["width"]))
    elif "shortest_edge" in size:
        base = (positive(record, "size.shortest_edge", size["shortest_edge"]),) * 2
    else:
        raise InputError(f"LLaVA-NeXT image processor size {size!r} is not one kvforge's runtime reproduces")
    crop = record.get("crop_size") or {}
    side = crop.get("height") or size.get("height") or size.get("shortest_edge")
    pinpoints = record.get("image_grid_pinpoints")
    if not isinstance(pinpoints, list) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in pinpoints):
        raise InputError(f"image processor record field image_grid_pinpoints is {pinpoints!r}; it must be a list of "
                         "[height, width]")
    return base, positive(record, "crop_size.height", side), [[positive(record, "image_grid_pinpoints", v)
                                                                for v in p] for p in pinpoints]


def _pad_to_square(array: np.ndarray, mean: list[float]) -> np.ndarray:
    """`array` centred on a square of its longest side filled with int(mean x 255) per channel (OneVision's
    pad_to_square for an image of a prompt with several)."""
    channels, height, width = array.shape
    if height == width:
        return array
    side = max(height, width)
    out = np.zeros((channels, side, side), dtype=array.dtype)
    for i, value in enumerate(mean):
        out[i] = int(value * 255)
    top, left = (side - height) // 2, (side - width) // 2
    out[:, top:top + height, left:left + width] = array
    return out


def llava_next_tiles(image: Any, record: dict[str, Any],
                     whole: bool = False) -> tuple[list[np.ndarray], int, int, tuple[int, int]]:
    """(tiles, rows, cols, (height, width)): the base image then the grid's tiles row by row, each float32 as the
    vision tower takes it; rows x cols the best resolution in tiles; the original size (the processor's
    image_sizes). whole: OneVision's image of a prompt with several images (one tile, padded to a square)."""
    base, side, pinpoints = _settings(record)
    resample = resample_of(record, BICUBIC)
    array = to_array(image, bool(record.get("do_convert_rgb", True)))
    height, width = array.shape[1:]
    rows = cols = 0
    if whole:
        mean = record["image_mean"] if isinstance(record["image_mean"], list) else [record["image_mean"]]
        parts = [_pad_to_square(array, mean)]
    else:
        best = select_best_resolution(height, width, pinpoints)
        new_h, new_w = fit_size(height, width, best)
        resized = resize(array, new_h, new_w, resample)
        top, left = (best[0] - new_h) // 2, (best[1] - new_w) // 2
        canvas = np.zeros((array.shape[0], *best), dtype=array.dtype)
        canvas[:, top:top + new_h, left:left + new_w] = resized
        rows, cols = math.ceil(best[0] / side), math.ceil(best[1] / side)
        parts = [resize(array, *base, resample)]
        parts += [canvas[:, r:r + side, c:c + side] for r in range(0, best[0], side) for c in range(0, best[1], side)]
    tiles = []
    for part in parts:
        if record.get("do_resize", True):
            part = resize_edge(part, record["size"], resample)
        if record.get("do_center_crop"):
            part = center_crop(part, record["crop_size"])
        tiles.append(finish(part, record))
    return tiles, rows, cols, (height, width)


def _unpadded(height: int, width: int, patches_h: int, patches_w: int, scale_h: int,
              scale_w: int) -> tuple[int, int]:
    """(features, newline features) of the grid's features with the padding rows or columns taken off (the
    processors' _get_unpadded_features)."""
    current_h, current_w = patches_h * scale_h, patches_w * scale_w
    if width / height > current_w / current_h:
        new_h = int(round(height * (current_w / width), 7))
        current_h -= (current_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (current_h / height), 7))
        current_w -= (current_w - new_w) // 2 * 2
    return current_h * current_w, current_h


def llava_next_token_count(size: tuple[int, int], tile: tuple[int, int], pinpoints: list[list[int]],
                           prompt: dict[str, Any]) -> int:
    """The image tokens LlavaNextProcessor writes for an image of `size` whose tiles are `tile` (height, width)."""
    best_h, best_w = select_best_resolution(*size, pinpoints)
    patch = positive(prompt, "patch_size", prompt.get("patch_size"))
    patches_h, patches_w = tile[0] // patch, tile[1] // patch
    features, newlines = _unpadded(*size, patches_h, patches_w, best_h // tile[0], best_w // tile[1])
    count = features + newlines + patches_h * patches_w + int(prompt.get("num_additional_image_tokens", 0))
    return count - 1 if prompt.get("vision_feature_select_strategy") == "default" else count


def _most_tiles(aspect: Any) -> int:
    """N of vision_aspect_ratio "anyres_max_N" (transformers strips the characters of "anyres_max_" off both ends)."""
    text = str(aspect).strip("anyres_max_")  # noqa: B005 (a character set, as transformers strips it)
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"processor field vision_aspect_ratio is {aspect!r}; kvforge takes \"anyres_max_N\"")
    return int(text)


def onevision_token_count(size: tuple[int, int], tile: tuple[int, int], pinpoints: list[list[int]],
                          prompt: dict[str, Any], whole: bool = False) -> int:
    """The image tokens LlavaOnevisionProcessor writes: num_image_tokens + 1 for an image of a prompt with several,
    else the base features and the unpadded grid's, the grid pooled down to vision_aspect_ratio's "anyres_max_N"
    tiles where it is over 1.1 times as large."""
    base = positive(prompt, "num_image_tokens", prompt.get("num_image_tokens"))
    if whole:
        count = base + 1
    else:
        best_h, best_w = select_best_resolution(*size, pinpoints)
        side = int(math.sqrt(base))
        features, newlines = _unpadded(*size, side, side, best_h // tile[0], best_w // tile[1])
        most = _most_tiles(prompt.get("vision_aspect_ratio", "anyres_max_9"))
        ratio = math.sqrt(features / (most * side**2))
        if ratio > 1.1:
            height, width = int(newlines // ratio), int(features // newlines // ratio)
            features, newlines = height * width, height
        count = features + newlines + base
    return count - 1 if prompt.get("vision_feature_select_strategy") == "default" else count


def llava_next_image(image: Any, record: dict[str, Any], prompt: dict[str, Any],
                     onevision: bool = False, whole: bool = False) -> TiledImage:
    """The image's tiles and the image tokens LlavaNextProcessor (onevision: LlavaOnevisionProcessor) writes for
    it; whole: OneVision's image of a prompt with several images."""
    tiles, rows, cols, size = llava_next_tiles(image, record, whole and onevision)
    tile = tiles[0].shape[1:]
    pinpoints = _settings(record)[2]
    count = (onevision_token_count(size, tile, pinpoints, prompt, whole) if onevision
             else llava_next_token_count(size, tile, pinpoints, prompt))
    return TiledImage(tiles, rows, cols, prompt.get("image_token", "<image>") * count, count, size)
