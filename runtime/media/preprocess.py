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

from kvforge.core.errors import InputError

# The processors whose pipeline this module is (their own extra steps, where they have any, are off in the
# record or refused below).
PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor")


def check_processor(record: dict[str, Any]) -> None:
    """InputError unless the runtime reproduces this processor record."""
    if record.get("class") not in PROCESSORS:
        raise InputError(f"image processor {record.get('class')!r} is not reproduced by kvforge's runtime (it "
                         f"reproduces {', '.join(PROCESSORS)})")
    size = record.get("size") or {}
    if record.get("do_resize") and not ("shortest_edge" in size or {"height", "width"} <= set(size)):
        raise InputError(f"image processor size {size!r} is not one kvforge's runtime reproduces")


def preprocess(image: Any, record: dict[str, Any]) -> np.ndarray:
    """[C, H, W] float32: a PIL image as the processor of `record` makes it."""
    array = _channels_first(image, bool(record.get("do_convert_rgb")))
    if record.get("do_resize"):
        array = _resize(array, record["size"], int(record.get("resample", 3)))
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
    """uint8 [C, H, W]: RGB with any transparency composited over white (to_rgb), else the image's own bands."""
    from PIL import Image

    if to_rgb:
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
