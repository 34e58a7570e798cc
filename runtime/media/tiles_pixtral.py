"""PixtralImageProcessor (Pixtral, Mistral 3): the image scaled down to fit size.longest_edge (never up), each side
then rounded up to whole patches, one image of its own size; and the [IMG] / [IMG_BREAK] / [IMG_END] layout
PixtralProcessor writes for it (Mistral 3 uses PixtralProcessor with spatial_merge_size 2: a token per merged
patch, and the image processor's patch size is then patch_size x spatial_merge_size, as the processor passes it).

transformers 5.24, models/pixtral/image_processing_pil_pixtral.py, models/pixtral/processing_pixtral.py.

Record fields: do_convert_rgb, do_resize, size {longest_edge} (or {height, width}), resample, do_rescale,
rescale_factor, do_normalize, image_mean, image_std (the record's patch_size is overridden by the processor's).
Prompt fields (the Processor's): patch_size, spatial_merge_size, image_token, image_break_token, image_end_token.
"""

from __future__ import annotations

import math
from typing import Any

from kvforge.core.errors import InputError
from kvforge.runtime.media.tile_ops import TiledImage, finish, positive, resample_of, resize, to_array

BICUBIC = 3


def pixtral_size(height: int, width: int, most: tuple[int, int], patch: int) -> tuple[int, int]:
    """(height, width) after the resize: scaled (floored) to fit `most`, then each side rounded up to a whole
    number of patches (transformers' get_resize_output_image_size). A side scaled to nothing stays 0 (the caller
    refuses it)."""
    ratio = max(height / most[0], width / most[1])
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


def pixtral_image(image: Any, record: dict[str, Any], prompt: dict[str, Any]) -> TiledImage:
    """The image (one [3, H, W] float32 tile of its own size, H and W whole patches) and PixtralProcessor's text
    for it: per row of patches one [IMG] a patch and [IMG_BREAK], the last [IMG_BREAK] made [IMG_END]."""
    patch = positive(prompt, "patch_size", prompt.get("patch_size", 16)) * positive(
        prompt, "spatial_merge_size", prompt.get("spatial_merge_size", 1))
    array = to_array(image, bool(record.get("do_convert_rgb", True)))
    if record.get("do_resize", True):
        size = record.get("size") or {}
        if "longest_edge" in size:
            most = (positive(record, "size.longest_edge", size["longest_edge"]),) * 2
        elif {"height", "width"} <= set(size):
            most = (positive(record, "size.height", size["height"]), positive(record, "size.width", size["width"]))
        else:
            raise InputError(f"PixtralImageProcessor size {size!r} is not one kvforge's runtime reproduces")
        height, width = pixtral_size(array.shape[1], array.shape[2], most, patch)
        if height < 1 or width < 1:
            raise InputError(f"a {array.shape[2]}x{array.shape[1]} image scaled to fit {most[1]}x{most[0]} pixels "
                             "has a side under one pixel; send a less elongated image")
        array = resize(array, height, width, resample_of(record, BICUBIC))
    height, width = array.shape[1:]
    rows, cols = height // patch, width // patch
    row = prompt.get("image_token", "[IMG]") * cols
    text = (row + prompt.get("image_break_token", "[IMG_BREAK]")) * (rows - 1) + row + prompt.get(
        "image_end_token", "[IMG_END]") if rows else ""
    return TiledImage([finish(array, record)], rows, cols, text, rows * cols, (height, width))
