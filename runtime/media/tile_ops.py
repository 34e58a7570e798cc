"""What the tiling image processors (tiles_*.py) share: the image a tiling processor takes, as transformers' PIL
backend makes it (RGB, channels first, uint8), Pillow resizes of it, and the rescale and normalisation each tile gets.

The arithmetic is preprocess.py's (transformers' PIL pipeline): resizes on uint8 with Pillow, rescale in float64
then float32, normalise in float32. Each family's module adds its own geometry and the text its processor writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.preprocess import _center_crop, _channels_first, _per_channel, _target_size

# The most pixels one intermediate resize may make (64 Mpx of RGB uint8 is 192 MiB): a record or an image that
# would go over it is refused before Pillow allocates it.
MAX_RESIZE_PIXELS = 1 << 26


@dataclass(frozen=True)
class TiledImage:
    """One image as a tiling processor makes it.

    tiles: [C, H, W] float32 arrays, in the order the processor puts them in its pixel_values.
    rows, cols: the tile grid as the processor counts it (Idefics3: 0, 0 for an image it did not split; GOT-OCR2:
    1, 1 for one tile; LLaVA-NeXT: the best resolution in tiles, the base image aside; Pixtral: the grid of patch
    tokens). text: what the Processor class writes in place of the image's placeholder. image_tokens: how many of
    text's tokens are image (feature) tokens. size: the (height, width) the processor reports in image_sizes, where it
    reports one (LLaVA-NeXT/OneVision: the original image; Pixtral: the resized image), else None.
    """

    tiles: list[np.ndarray]
    rows: int
    cols: int
    text: str
    image_tokens: int
    size: tuple[int, int] | None = None


def to_array(image: Any, to_rgb: bool = True) -> np.ndarray:
    """uint8 [C, H, W] of a PIL image as the processor takes it (RGB, transparency over white); InputError for an
    image with no pixels."""
    if not hasattr(image, "mode") or not hasattr(image, "size"):
        raise InputError(f"an image must be a PIL image, not {type(image).__name__}")
    width, height = image.size
    if width < 1 or height < 1:
        raise InputError(f"an image of {width}x{height} pixels has no pixels to process; send a non-empty image")
    return _channels_first(image, to_rgb)


def resize(array: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 [C, height, width]: `array` resized with Pillow (transformers' PIL backend resize)."""
    from PIL import Image

    if height < 1 or width < 1 or height * width > MAX_RESIZE_PIXELS:
        raise InputError(f"an image would be resized to {width}x{height} pixels; send a less elongated image")
    if array.shape[1:] == (height, width):  # Pillow returns a copy at the same size: skip the round trip
        return array
    channels_last = np.moveaxis(array, 0, -1)
    image = Image.fromarray(channels_last[..., 0] if channels_last.shape[-1] == 1 else channels_last)
    resized = np.array(image.resize((width, height), resample=resample))
    return resized[None] if resized.ndim == 2 else np.moveaxis(resized, -1, 0)


def resize_edge(array: np.ndarray, size: dict[str, Any], resample: int) -> np.ndarray:
    """`array` resized to `size` as the PIL backend's resize takes it: {"height", "width"} or {"shortest_edge"}."""
    height, width = _target_size(array.shape[1], array.shape[2], size)
    return resize(array, height, width, resample)


def center_crop(array: np.ndarray, size: dict[str, Any]) -> np.ndarray:
    """The centre size["height"] x size["width"] of `array` (padded with zeros around it where smaller)."""
    return _center_crop(array, int(size["height"]), int(size["width"]))


def finish(array: np.ndarray, record: dict[str, Any]) -> np.ndarray:
    """float32 [C, H, W]: the processor's rescale (float64 then float32) and normalisation of one tile."""
    if record.get("do_rescale", True):
        array = (array.astype(np.float64) * float(record.get("rescale_factor", 1 / 255))).astype(np.float32)
    if record.get("do_normalize", True):
        array = array.astype(np.float32) if not np.issubdtype(array.dtype, np.floating) else array
        mean = np.array(_per_channel(record["image_mean"], array.shape[0]), dtype=array.dtype)
        std = np.array(_per_channel(record["image_std"], array.shape[0]), dtype=array.dtype)
        array = ((array.T - mean) / std).T
    return np.ascontiguousarray(array, dtype=np.float32)


def resample_of(record: dict[str, Any], default: int) -> int:
    """The record's Pillow resample filter (transformers' PILImageResampling value), `default` where unset."""
    value = record.get("resample")
    return default if value is None else int(value)


def positive(record: dict[str, Any], field: str, value: Any) -> int:
    """`value` as a positive int; InputError naming the record's `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 1:
        raise InputError(f"image processor record field {field} is {value!r}; it must be a positive integer")
    return int(value)
