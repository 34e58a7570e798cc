"""Images into a vision-language export without torch: preprocessing equal to transformers' processor per family
on 20 images of varied sizes and modes, and hostile images refused with InputError (never a crash)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from kvforge.core.errors import InputError
from kvforge.runtime.media.images import ImageLimits, decode_data_url, load_image
from kvforge.runtime.media.preprocess import preprocess

# (height, width, mode): RGB, RGBA, grey, grey with alpha, palette, tall, wide, tiny, square, odd sizes.
IMAGES = [(70, 90, "RGB"), (90, 70, "RGBA"), (56, 56, "L"), (300, 40, "RGB"), (40, 300, "RGB"), (13, 17, "RGB"),
          (200, 201, "LA"), (57, 1000, "P"), (2, 2, "RGB"), (512, 384, "RGB"), (33, 99, "RGBA"), (640, 480, "L"),
          (128, 128, "P"), (1000, 57, "RGB"), (77, 76, "RGBA"), (64, 65, "RGB"), (250, 125, "LA"), (3, 400, "RGB"),
          (96, 160, "RGB"), (160, 96, "RGBA")]


def _image(seed: int, height: int, width: int, mode: str):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 4) * 255).astype(np.uint8), "RGBA").convert(mode)


def _families() -> list[str]:
    pytest.importorskip("transformers")
    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.tools.vlm_fixtures import TINY_VLMS

    # One fixed-size image per place; Qwen-VL's processors (images at their own size): test_qwen_vl_inputs.py.
    return sorted(name for name in TINY_VLMS if name in VISION_FAMILIES and not VISION_FAMILIES[name].patches
                  and not VISION_FAMILIES[name].tiling)  # tiled: test_tiling_inputs.py


@pytest.mark.parametrize("family", _families())
def test_preprocessing_equals_transformers_processor(family: str, tmp_path: Path) -> None:
    from transformers import AutoImageProcessor

    from kvforge.exporter.vision import processor_record
    from kvforge.tools.vlm_fixtures import save_tiny_processor

    save_tiny_processor(family, tmp_path)
    record = processor_record(tmp_path)
    hf = AutoImageProcessor.from_pretrained(tmp_path)
    compared = 0
    for seed, (height, width, mode) in enumerate(IMAGES):
        image = _image(seed, height, width, mode)
        ours = preprocess(image, record)
        assert ours.dtype == np.float32 and ours.shape[0] == 3
        if height == 3 and record["class"] == "VideoLlavaImageProcessor":
            continue  # transformers' older pipeline takes a 3-row image's rows for channels (it warns "ambiguous")
        try:
            out = hf(images=image, return_tensors="np")
        except ValueError:  # transformers' processor fails on this mode (no do_convert_rgb): kvforge converts it
            assert image.mode != "RGB"
            continue
        theirs = out["pixel_values"] if "pixel_values" in out else out["pixel_values_images"]
        if theirs.shape[1] != 3:  # transformers passes 1 or 4 channels on, which no tower takes: kvforge converts
            assert image.mode != "RGB"
            continue
        np.testing.assert_array_equal(ours, theirs[0])
        compared += 1
    rgb = sum(mode == "RGB" for _, _, mode in IMAGES)  # every processor takes RGB; those with do_convert_rgb all
    assert compared >= (rgb - 1 if record["class"] == "VideoLlavaImageProcessor" else rgb)
    if record.get("do_convert_rgb"):
        assert compared >= len(IMAGES) - 1


def _png(width: int, height: int, data: bytes = b"") -> bytes:
    """A PNG whose header says width x height, with `data` as its (possibly incomplete) pixel stream."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(data)) + chunk(b"IEND", b"")


def _encoded(image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_good_images_load_from_every_source(tmp_path: Path) -> None:
    image = _image(0, 30, 40, "RGB")
    data = _encoded(image)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    loaded = [load_image(source) for source in (path, str(path), data, url)]
    assert len({one.digest for one in loaded}) == 1  # the same bytes, the same key
    assert all(np.array_equal(np.array(one.image), np.array(image)) for one in loaded)
    assert load_image(np.array(image)).image.size == (40, 30)
    assert load_image(image).image is image
    jpeg = load_image(_encoded(image, "JPEG"))
    webp = load_image(_encoded(image, "WEBP"))
    assert jpeg.image.size == webp.image.size == (40, 30)


@pytest.mark.parametrize("source, message", [
    (_png(64, 64)[:60], "could not be decoded"),  # truncated
    (_png(64, 64, b"\0" * 100), "could not be decoded"),  # too few pixels for its header
    (_png(20_000, 20_000), "over the limit of"),  # 400 million pixels, refused from the header
    (_png(1, 1, b"\0\0\0\0"), "under the smallest side"),
    (_png(10_000, 5), "times as long as"),
    (b"GIF89a not really", "could not be decoded"),
    (b"", "could not be decoded"),
    ("data:image/png;base64,@@@notbase64@@@", "does not decode"),
    ("https://example.com/cat.png", "inline images only"),
    ("data:text/plain;base64,aGVsbG8=", "inline images only"),
    (12, "must be a file path"),
    (np.zeros((4, 4, 2), np.uint8), r"uint8 \[H, W\]"),
])
def test_hostile_images_are_input_errors(source, message) -> None:
    with pytest.raises(InputError, match=message):
        load_image(source)


def test_a_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    from PIL import Image

    bomb = _encoded(Image.new("L", (6000, 6000)))  # 36 Mpx of zeros: a few kB compressed
    assert len(bomb) < 100_000
    with pytest.raises(InputError, match="over the limit of 10000000 pixels"):
        load_image(bomb, ImageLimits(max_pixels=10_000_000))


def test_byte_and_count_limits() -> None:
    data = _encoded(_image(1, 20, 20, "RGB"))
    with pytest.raises(InputError, match="over the limit of 100"):
        load_image(data, ImageLimits(max_bytes=100))
    with pytest.raises(InputError, match="over 100 bytes"):
        decode_data_url("data:image/png;base64," + base64.b64encode(data).decode(), ImageLimits(max_bytes=100))


def test_the_docs_table_lists_every_vision_family_and_each_has_a_tiny_checkpoint() -> None:
    import re

    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.tools.vlm_fixtures import TINY_VLMS

    page = (Path(__file__).parents[2] / "docs" / "vision.md").read_text()
    listed = set(re.findall(r"^\| `([a-z0-9_]+)`", page, flags=re.MULTILINE))
    assert listed - {"model_type"} == set(VISION_FAMILIES) == set(TINY_VLMS)  # (the header row aside)
