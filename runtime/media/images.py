"""Images a caller hands the runtime, read without torch: a local file, bytes, a `data:` URL, a PIL image or an
array; each checked against limits before it is decoded, so a hostile image (a decompression bomb, a truncated
file, a 1x1 or a 20,000 x 20,000 picture, wrong base64) is an InputError naming what was wrong, never a crash.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be: its encoded bytes, its pixels (checked from the header, before decoding), its
    shortest side and its aspect ratio; and how many images one request may carry."""

    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    min_side: int = 2
    max_aspect: float = 200.0
    max_images: int = 8


DEFAULT_LIMITS = ImageLimits()
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what PIL may decode here
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif|bmp);base64,(.*)$", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image (PIL, its own mode) and the sha256 of what identifies it: its encoded bytes, or an array's
    shape, dtype and bytes (a cached prefix is keyed by it)."""

    image: Any
    digest: str


def decode_data_url(url: str, limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; anything else (a remote URL, another scheme, bad base64) an
    InputError saying that only inline images are read."""
    if not isinstance(url, str):
        raise InputError(f"an image URL must be a string, got {type(url).__name__}")
    match = _DATA_URL.match(url.strip())
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise InputError(f"image URL {shown!r} is not read: kvforge reads inline images only, as data:image/png, "
                         "jpeg, webp, gif or bmp;base64 URLs (it never fetches a remote URL)")
    payload = match.group(2)
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise InputError(f"an inline image is over {limits.max_bytes} bytes; send a smaller image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise InputError(f"an inline image's base64 does not decode ({err})") from None


def load_image(source: Any, limits: ImageLimits = DEFAULT_LIMITS) -> LoadedImage:
    """`source` (a path, bytes, a data: URL, a PIL image, or a uint8 array [H, W] / [H, W, 1|3|4]) decoded and
    checked against `limits`."""
    from PIL import Image

    if isinstance(source, LoadedImage):  # read and checked already (the server reads images before admission)
        return source
    if isinstance(source, Image.Image):
        _check_size(source.width, source.height, limits)
        return LoadedImage(source, hashlib.sha256(source.tobytes()).hexdigest())
    if isinstance(source, np.ndarray):
        return _from_array(source, limits)
    if isinstance(source, str) and (source.startswith("data:") or "://" in source):
        source = decode_data_url(source, limits)  # a remote URL is refused there
    elif isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise InputError(f"image {path} is not a file")
        if path.stat().st_size > limits.max_bytes:
            raise InputError(f"image {path} is {path.stat().st_size} bytes, over the limit of {limits.max_bytes}")
        source = path.read_bytes()
    if not isinstance(source, bytes | bytearray):
        raise InputError(f"an image must be a file path, bytes, a data: URL, a PIL image or a numpy array, got "
                         f"{type(source).__name__}")
    if len(source) > limits.max_bytes:
        raise InputError(f"an image of {len(source)} bytes is over the limit of {limits.max_bytes}")
    return LoadedImage(_decode(bytes(source), limits), hashlib.sha256(source).hexdigest())


def _decode(data: bytes, limits: ImageLimits) -> Any:
    """PIL's decoding of `data`: the header's size checked first, then every pixel read (a truncated file fails
    here, not later)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data), formats=FORMATS)
            _check_size(opened.width, opened.height, limits)
            opened.load()
    except InputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"an image is over the limit of {limits.max_pixels} pixels") from None
    except Exception as err:  # noqa: BLE001 - PIL raises many types for a malformed file
        raise InputError(f"an image could not be decoded ({type(err).__name__}: {err}); send a complete PNG, JPEG, "
                         "WebP, GIF or BMP file") from None
    return opened


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise InputError(f"an image of {width}x{height} pixels is over the limit of {limits.max_pixels} pixels")
    if min(width, height) < limits.min_side:
        raise InputError(f"an image of {width}x{height} pixels is under the smallest side of {limits.min_side}")
    if max(width, height) > limits.max_aspect * min(width, height):
        raise InputError(f"an image of {width}x{height} pixels is more than {limits.max_aspect:g} times as long as "
                         "it is wide")


def _from_array(array: np.ndarray, limits: ImageLimits) -> LoadedImage:
    from PIL import Image

    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise InputError(f"an image array must be uint8 [H, W] or [H, W, 1|3|4], got {array.dtype} {array.shape}")
    _check_size(array.shape[1], array.shape[0], limits)
    array = np.ascontiguousarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    digest = hashlib.sha256(f"{array.shape}{array.dtype}".encode() + array.tobytes()).hexdigest()
    return LoadedImage(Image.fromarray(array), digest)
