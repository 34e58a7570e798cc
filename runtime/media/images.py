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
    max_frames: int = 32  # the frames of one video (runtime/media/video.py)


DEFAULT_LIMITS = ImageLimits()
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what PIL may decode here
_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")
EXIF_ORIENTATION = 0x0112
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail values, taken and ignored (one fixed size per image)
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif|bmp);base64,(.*)$", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image (PIL, its own mode; None once encoded, drivers/images.py) and the sha256 of what identifies
    it: its encoded bytes, a PIL image's mode, size, palette and pixels (pil_digest), or an array's shape, dtype and
    bytes (its kept features and a cached prefix are keyed by it)."""

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
        return LoadedImage(source, pil_digest(source))
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
    return LoadedImage(_upright(_decode(bytes(source), limits)), hashlib.sha256(source).hexdigest())


def pil_digest(image: Any) -> str:
    """The sha256 of what a PIL image's preprocessing reads: its mode, size, palette and transparency as well as its
    pixel bytes (two palette images with the same indices but other colours are other images)."""
    palette = image.palette
    colours = b"" if palette is None else bytes(image.getpalette(palette.mode) or ())
    head = repr((image.mode, image.size, None if palette is None else palette.mode, image.info.get("transparency")))
    digest = hashlib.sha256(head.encode())
    digest.update(len(colours).to_bytes(8, "little") + colours)
    digest.update(image.tobytes())
    return digest.hexdigest()


def _upright(image: Any) -> Any:
    """An encoded image as transformers' load_image reads a path or a data URL: turned upright by its EXIF
    orientation (a PIL image or an array handed in is taken as it is, as transformers' processors take it)."""
    from PIL import ImageOps

    if image.getexif().get(EXIF_ORIENTATION, 1) == 1:
        return image
    try:
        return ImageOps.exif_transpose(image)
    except Exception as err:  # noqa: BLE001 - PIL raises many types for a malformed EXIF block
        raise InputError(f"an image's EXIF orientation could not be applied ({type(err).__name__}); send the "
                         "image without EXIF data") from None


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
    except Image.UnidentifiedImageError:
        raise InputError("an image could not be decoded: its bytes are not a PNG, JPEG, WebP, GIF or BMP file; send "
                         "one of those") from None
    except Exception as err:  # noqa: BLE001 - PIL raises many types for a malformed file
        raise InputError(f"an image could not be decoded ({type(err).__name__}: {_without_reprs(str(err))}); send a "
                         "complete PNG, JPEG, WebP, GIF or BMP file") from None
    return opened


def _without_reprs(text: str) -> str:
    """`text` without object reprs such as <_io.BytesIO object at 0x7f...> (a memory address tells a client nothing)."""
    return _REPR.sub("the image", text)


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


def check_image_parts(messages: Any) -> int:
    """How many image content parts `messages` hold, each OpenAI image_url's `detail` checked: "auto", "low" or
    "high" are taken (and change nothing: every image is made the one size the vision graph takes), another value is
    an InputError naming it."""
    count = 0
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image", "video"):
                continue
            count += 1
            image = part.get("image_url")
            if kind == "image_url" and isinstance(image, dict) and "detail" in image \
                    and image["detail"] not in DETAILS:
                raise InputError(f"messages[{i}].content[{j}].image_url.detail is {str(image['detail'])[:40]!r}; "
                                 f"it takes {', '.join(map(repr, DETAILS))} (each image is encoded at the one size "
                                 "the model's vision graph takes, whatever the detail)")
    return count
