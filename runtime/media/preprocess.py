"""An image as the vision graph takes it, made with numpy and Pillow from the processor record the export wrote
(exporter/vision.py: transformers' image processor as it resolved the checkpoint's preprocessor_config.json).

The steps are transformers' PIL pipeline, in its order and arithmetic: to RGB (transparency over white), resize
with Pillow, centre crop, rescale in float64 then float32, normalise in float32. tests/test_vision_preprocess.py
compares the result with transformers' own processor on varied images.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvforge.core.contract import IMAGE_PROCESSORS
from kvforge.core.errors import InputError

# The processors whose pipeline this module is (their own extra steps, where they have any, are off in the
# record or refused below). LONGEST_SIDE: the longest side resized to `size` (at least `min_size`), then padded to
# a square in `background_color` (DeepSeek-VL's and Janus's).
LONGEST_SIDE = ("DeepseekVLImageProcessor", "JanusImageProcessor")
PROCESSORS = IMAGE_PROCESSORS


def check_processor(record: dict[str, Any]) -> None:
    """InputError unless the runtime reproduces this processor record."""
    if record.get("class") not in PROCESSORS:
        raise InputError(f"image processor {record.get('class')!r} is not reproduced by kvforge's runtime (it "
                         f"reproduces {', '.join(PROCESSORS)})")
    if record.get("do_pan_and_scan"):
        raise InputError("image processor do_pan_and_scan (Gemma 3's extra crops) is not reproduced by kvforge's runtime")
    if record.get("crop_to_patches"):
        raise InputError("image processor crop_to_patches (tiling an image into patches) is not reproduced by "
                         "kvforge's runtime yet; export a checkpoint whose processor has it off")
    size = record.get("size") or {}
    if record.get("do_resize") and not ("shortest_edge" in size or {"height", "width"} <= set(size)):
        raise InputError(f"image processor size {size!r} is not one kvforge's runtime reproduces")


def preprocess(image: Any, record: dict[str, Any]) -> np.ndarray:
    """[C, H, W] float32: a PIL image as the processor of `record` makes it."""
    array = _channels_first(image, bool(record.get("do_convert_rgb")))
    longest = record.get("class") in LONGEST_SIDE
    if record.get("do_resize"):
        size = _longest_side(array, record) if longest else record["size"]
        array = _resize(array, size, int(record.get("resample", 3)))
    if longest and record.get("do_pad"):
        array = _pad_to_square(array, record.get("background_color") or [0])
    if record.get("do_center_crop"):
        crop = record["crop_size"]
        array = _center_crop(array, int(crop["height"]), int(crop["width"]))
    if record.get("do_rescale"):
        array = (array.astype(np.float64) * record["rescale_factor"]).astype(np.float32)
    if record.get("do_normalize"):
        array = array.astype(np.float32) if not np.issubdtype(array.dtype, np.floating) else array
        mean = np.array(_per_channel(record["image_mean"], array.shape[0]), dtype=array.dtype)
        std = np.array(_per_channel(record["image_std"], array.shape[0]), dtype=array.dtype)
        array = ((array.T - mean) / std).T
    return np.ascontiguousarray(array, dtype=np.float32)


def _per_channel(value: Any, channels: int) -> list[float]:
    return list(value) if isinstance(value, list | tuple) else [value] * channels


def _channels_first(image: Any, to_rgb: bool) -> np.ndarray:
    """uint8 [C, H, W] RGB, any transparency composited over white. A processor without do_convert_rgb keeps an RGB
    image as it is, as transformers does; another mode, which its vision tower cannot take (transformers' processor
    fails on it or passes on 1 or 4 channels), is converted here too."""
    from PIL import Image

    if to_rgb or image.mode != "RGB":
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        else:
            image = image.convert("RGB")
    array = np.array(image)
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def _target_size(height: int, width: int, size: dict[str, Any]) -> tuple[int, int]:
    """(height, width) after the resize: a fixed size, or the shortest edge to `shortest_edge` keeping the aspect
    ratio (the long side truncated, as transformers does)."""
    if "shortest_edge" in size:
        edge = int(size["shortest_edge"])
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(edge * long / short)
        return (new_long, edge) if width <= height else (edge, new_long)
    return int(size["height"]), int(size["width"])


def _resize(array: np.ndarray, size: dict[str, Any], resample: int) -> np.ndarray:
    from PIL import Image

    height, width = _target_size(array.shape[1], array.shape[2], size)
    if height * width > 1 << 26:
        raise InputError(f"an image would be resized to {width}x{height} pixels; send a less elongated image")
    channels_last = np.moveaxis(array, 0, -1)
    image = Image.fromarray(channels_last[..., 0] if channels_last.shape[-1] == 1 else channels_last)
    resized = np.array(image.resize((width, height), resample=resample))
    return resized[None] if resized.ndim == 2 else np.moveaxis(resized, -1, 0)


def _longest_side(array: np.ndarray, record: dict[str, Any]) -> dict[str, int]:
    """The size that makes the longest side `size` (a square's side), each side at least `min_size`."""
    height, width = array.shape[1:]
    delta = record["size"]["height"] / max(height, width)
    least = int(record.get("min_size") or 1)
    return {"height": max(round(height * delta), least), "width": max(round(width * delta), least)}


def _pad_to_square(array: np.ndarray, color: list[int]) -> np.ndarray:
    """The image centred on a square of its longest side, filled with `color` per channel."""
    channels, height, width = array.shape
    if height == width:
        return array
    side = max(height, width)
    padded = np.zeros((channels, side, side), dtype=array.dtype)
    for i, value in enumerate(color if isinstance(color, list | tuple) else [color]):
        padded[i] = value
    if width > height:
        start = (side - height) // 2
        padded[:, start:start + height, :] = array
    else:
        start = (side - width) // 2
        padded[:, :, start:start + width] = array
    return padded


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre `height` x `width` (an image smaller than that is first padded with zeros around it)."""
    orig_h, orig_w = array.shape[1:]
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return array[:, top:top + height, left:left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((array.shape[0], new_h, new_w), dtype=array.dtype)
    pad_top, pad_left = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[:, pad_top:pad_top + orig_h, pad_left:pad_left + orig_w] = array
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return padded[:, top:top + height, left:left + width]
