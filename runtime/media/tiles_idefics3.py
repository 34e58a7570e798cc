"""Idefics3ImageProcessor / SmolVLMImageProcessor (their PIL backends are the same code): the longest edge resized
to size.longest_edge (the other side even, both under 4096), then with do_image_splitting the image resized up to
multiples of max_image_size.longest_edge and cut into those squares row by row, followed by the whole image resized
to one square (the global image); and the text Idefics3Processor / SmolVLMProcessor write for it.

transformers 5.24, models/idefics3/image_processing_pil_idefics3.py (smolvlm/image_processing_pil_smolvlm.py is a
copy), models/idefics3/processing_idefics3.py, models/smolvlm/processing_smolvlm.py.

Record fields: do_convert_rgb, do_resize, size {longest_edge} (or {height, width}), resample (LANCZOS by default),
do_rescale, rescale_factor, do_normalize, image_mean, image_std, do_image_splitting, max_image_size {longest_edge}.
(do_pad pads the images of a batch to the largest: one image's tiles are all one size, so it changes nothing here.)
Prompt fields (the Processor's): image_seq_len; SmolVLM reads fake_image_token, image_token, global_image_token
from its tokenizer (the defaults below are Idefics3's fixed ones and SmolVLM's fallbacks).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.tile_ops import TiledImage, finish, positive, resample_of, resize, to_array

LANCZOS = 1
MAX_IMAGE_SIZE = 4096  # transformers' "4k resolution as absolute maximum" for the first resize


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest side `longest`, the other side made even (transformers'
    _resize_output_size_rescale_to_max_len), then scaled under MAX_IMAGE_SIZE (…_scale_below_upper_bound)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def encoder_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of `tile`, the short side from the rounded long side's aspect
    (transformers' resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _first_size(array: np.ndarray, record: dict[str, Any]) -> tuple[int, int]:
    size = record.get("size") or {}
    if "longest_edge" in size:
        return longest_edge_size(array.shape[1], array.shape[2], positive(record, "size.longest_edge",
                                                                          size["longest_edge"]))
    if {"height", "width"} <= set(size):
        return positive(record, "size.height", size["height"]), positive(record, "size.width", size["width"])
    raise InputError(f"Idefics3ImageProcessor size {size!r} is not one kvforge's runtime reproduces (it takes "
                     "{longest_edge} or {height, width})")


def idefics3_tiles(image: Any, record: dict[str, Any]) -> tuple[list[np.ndarray], int, int]:
    """(tiles, rows, cols): the split squares row by row then the global image, each [3, tile, tile] float32
    (tile = max_image_size.longest_edge); rows = cols = 0 where the image was not split (one tile, the image)."""
    resample = resample_of(record, LANCZOS)
    tile = positive(record, "max_image_size.longest_edge", (record.get("max_image_size") or {}).get("longest_edge"))
    array = to_array(image, bool(record.get("do_convert_rgb", True)))
    if record.get("do_resize", True):
        array = resize(array, *_first_size(array, record), resample)
    rows = cols = 0
    if not record.get("do_image_splitting", True):
        tiles = [resize(array, tile, tile, resample)]
    else:
        array = resize(array, *encoder_multiple_size(array.shape[1], array.shape[2], tile), resample)
        height, width = array.shape[1:]
        if height > tile or width > tile:
            rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
            tiles = [array[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows)
                     for c in range(cols)]
            tiles.append(resize(array, tile, tile, resample))
        else:
            tiles = [array]
    return [finish(one, record) for one in tiles], rows, cols


def idefics3_text(rows: int, cols: int, prompt: dict[str, Any]) -> tuple[str, int]:
    """(text, image tokens) the processor writes for an image split rows x cols: per tile the fake token,
    <row_r_col_c> and image_seq_len image tokens, a newline after each row, then a newline and the global image
    (fake token, global-image tag, image tokens, fake token); an unsplit image is the global image alone."""
    seq = positive(prompt, "image_seq_len", prompt.get("image_seq_len", 169))
    fake = prompt.get("fake_image_token", "<fake_token_around_image>")
    image = prompt.get("image_token", "<image>")
    whole = fake + prompt.get("global_image_token", "<global-img>") + image * seq + fake
    if rows == 0 and cols == 0:
        return whole, seq
    grid = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>" + image * seq for c in range(cols)) + "\n"
                   for r in range(rows))
    return grid + "\n" + whole, seq * (rows * cols + 1)


def idefics3_image(image: Any, record: dict[str, Any], prompt: dict[str, Any]) -> TiledImage:
    """The image's tiles and Idefics3Processor's (SmolVLMProcessor's) text for it."""
    tiles, rows, cols = idefics3_tiles(image, record)
    text, count = idefics3_text(rows, cols, prompt)
    return TiledImage(tiles, rows, cols, text, count)
