"""Tiling image processors without torch (runtime/media/tiles_*.py): on the 20 images of test_vision_inputs (odd
sizes, modes, aspect ratios) and a few more, each image's tiles equal transformers' PIL-backend pixel_values exactly
(same Pillow resizes on uint8, same float64-then-float32 rescale, same float32 normalisation: no tolerance), and the
text, image-token count and grid equal what the family's Processor class writes, built here from a tiny tokenizer
(kvforge.models.tokenizer.build_tokenizer plus the family's special tokens; no downloads). Bad input is one
InputError."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from test_vision_inputs import IMAGES, _image  # noqa: E402

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime.media.tile_ops import TiledImage  # noqa: E402

# More shapes where tiling differs: a near-square large image, exact tile multiples, extreme strips.
EXTRA = [(1200, 900, "RGB"), (56, 112, "RGB"), (112, 56, "RGBA"), (1, 300, "L"), (700, 2, "RGB")]
ALL_IMAGES = IMAGES + EXTRA
TEXT = "look: {} and say"


def _tokenizer(tokens: list[str], names: dict[str, str] | None = None) -> Any:
    """The tiny byte-level BPE with `tokens` added as special tokens; `names` as transformers' extra_special_tokens
    (the tokenizer attributes a processor reads, e.g. InternVL's start_image_token)."""
    from transformers import PreTrainedTokenizerFast

    from kvforge.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(300)
    tokenizer.add_special_tokens(tokens)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token=None, extra_special_tokens=names or {})


def _no_videos(cls: type) -> type:
    """`cls` taking no video processor (transformers' video processors need torchvision, which is not installed)."""
    class NoVideos(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return NoVideos


def _record(processor: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """The image processor's `fields` as exporter/vision.py's processor_record writes them (SizeDict as a dict, an
    enum as its value, tuples as lists)."""
    record: dict[str, Any] = {"class": type(processor).__name__.removesuffix("Pil")}
    for field in fields:
        value = getattr(processor, field, None)
        if dataclasses.is_dataclass(value):
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif hasattr(value, "value"):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        record[field] = value
    return record


BASE_FIELDS = ("do_convert_rgb", "do_resize", "size", "resample", "do_rescale", "rescale_factor", "do_normalize",
               "image_mean", "image_std")


def _compare(ours: TiledImage, processor: Any, image: Any, placeholder: str, image_token: str,
             pixels: Any = None) -> dict[str, Any]:
    """Assert `ours` equals the processor's output for `image` in TEXT: tiles (exact), the text it wrote for the
    image, the ids of the whole prompt and the image-token count. The processor's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[image], text=[TEXT.format(placeholder)], return_text_replacement_offsets=True)
    theirs = np.asarray(out["pixel_values"] if pixels is None else pixels(out))
    theirs = theirs.reshape(-1, *theirs.shape[-3:])
    assert len(ours.tiles) == theirs.shape[0]
    for tile, their in zip(ours.tiles, theirs, strict=True):
        assert tile.dtype == np.float32 and tile.shape == their.shape
        np.testing.assert_array_equal(tile, their)
    assert [one["replacement"] for one in out["text_replacement_offsets"][0]] == [ours.text]
    ids = processor.tokenizer(TEXT.format(ours.text))["input_ids"]
    assert list(out["input_ids"][0]) == ids
    assert ids.count(processor.tokenizer.convert_tokens_to_ids(image_token)) == ours.image_tokens
    return out


# --- 1. GotOcr2ImageProcessor, crop_to_patches (InternVL, Aya Vision) ---------------------------------------------

GOT_FIELDS = (*BASE_FIELDS, "crop_to_patches", "min_patches", "max_patches")
GOT_SETTINGS = [{"size": {"height": 28, "width": 28}, "max_patches": 6},
                {"size": {"height": 24, "width": 32}, "min_patches": 2, "max_patches": 4, "resample": 2},
                {"size": {"height": 28, "width": 28}, "max_patches": 12, "crop_to_patches": True}]


def _got_processor(settings: dict[str, Any]) -> Any:
    return transformers.GotOcr2ImageProcessorPil(**{"crop_to_patches": False, **settings})


@pytest.mark.parametrize("settings", GOT_SETTINGS)
def test_internvl_tiles_and_text_equal_transformers(settings: dict[str, Any]) -> None:
    from kvforge.runtime.media.tiles_got_ocr2 import best_grid, internvl_image

    names = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
             "video_token": "<video>"}
    tokenizer = _tokenizer(["<img>", "</img>", "<IMG_CONTEXT>", "<video>"], names)
    image_processor = _got_processor(settings)
    processor = _no_videos(transformers.InternVLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                           image_seq_length=3)
    record = _record(image_processor, GOT_FIELDS)
    prompt = {"image_seq_length": 3, **names}
    grids = set()
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        ours = internvl_image(image, record, prompt)
        out = _compare(ours, processor, image, "<IMG_CONTEXT>", "<IMG_CONTEXT>")
        tile = (record["size"]["height"], record["size"]["width"])
        cols, rows = best_grid(height, width, tile, record["min_patches"], record["max_patches"])
        assert (ours.rows, ours.cols) == (rows, cols)
        assert image_processor.get_number_of_image_patches(height, width, {"crop_to_patches": True}) == \
            len(ours.tiles) == np.asarray(out["pixel_values"]).shape[0]
        grids.add((rows, cols))
    assert len(grids) >= 4  # the images do take several grids


@pytest.mark.parametrize("settings", GOT_SETTINGS[:2])
def test_aya_vision_tiles_and_text_equal_transformers(settings: dict[str, Any]) -> None:
    from kvforge.runtime.media.tiles_got_ocr2 import aya_vision_image

    tokens = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "<|IMG_TILE|>",
              "<|IMG_TILE_GLOBAL|>"]
    tokenizer = _tokenizer(tokens)
    image_processor = _got_processor(settings)
    # the released processor_config's values, at test size: 14-pixel patches, downsampled 2x, 28-pixel tiles
    prompt = {"patch_size": 7, "img_size": 28, "downsample_factor": 2, "tile_token": "<|IMG_TILE|>",
              "tile_global_token": "<|IMG_TILE_GLOBAL|>"}
    processor = transformers.AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, **prompt)
    record = _record(image_processor, GOT_FIELDS)
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        ours = aya_vision_image(image, record, prompt)
        _compare(ours, processor, image, "<image>", "<|IMG_PATCH|>")
        assert ours.image_tokens == 4 * len(ours.tiles)
        if len(ours.tiles) > 1:  # the tile markers: the tile token, then the text "_1", "_2", ...
            assert f"<|IMG_TILE|>_{len(ours.tiles) - 1}<|IMG_PATCH|>" in ours.text


def test_got_ocr2_without_crop_to_patches_is_one_resized_tile() -> None:
    from kvforge.runtime.media.tiles_got_ocr2 import got_ocr2_tiles

    image_processor = _got_processor({"size": {"height": 28, "width": 28}})
    record = _record(image_processor, GOT_FIELDS)
    for seed, (height, width, mode) in enumerate(IMAGES):
        image = _image(seed, height, width, mode)
        tiles, rows, cols = got_ocr2_tiles(image, record)
        theirs = image_processor(image, return_tensors="np")["pixel_values"]
        assert (rows, cols, len(tiles)) == (1, 1, 1)
        np.testing.assert_array_equal(tiles[0], theirs[0])


def test_got_ocr2_bad_input_is_one_input_error() -> None:
    from PIL import Image

    from kvforge.runtime.media.tiles_got_ocr2 import got_ocr2_tiles, internvl_image

    record = _record(_got_processor({"size": {"height": 28, "width": 28}}), GOT_FIELDS)
    with pytest.raises(InputError, match="0x5 pixels has no pixels"):
        internvl_image(Image.new("RGB", (0, 5)), record, {})
    with pytest.raises(InputError, match="must be a PIL image"):
        got_ocr2_tiles(np.zeros((4, 4, 3), np.uint8), record)
    with pytest.raises(InputError, match="max_patches is 1000"):
        got_ocr2_tiles(_image(0, 8, 8, "RGB"), {**record, "max_patches": 1000}, True)
    with pytest.raises(InputError, match="size .* is not one"):
        got_ocr2_tiles(_image(0, 8, 8, "RGB"), {**record, "size": {"shortest_edge": 28}})


# --- 2. Idefics3ImageProcessor / SmolVLMImageProcessor ------------------------------------------------------------

IDEFICS_FIELDS = (*BASE_FIELDS, "do_image_splitting", "max_image_size", "do_pad")
IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", "<video>",
                  *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]
IDEFICS_SETTINGS = [{"size": {"longest_edge": 84}, "max_image_size": {"longest_edge": 28}},
                    {"size": {"longest_edge": 100}, "max_image_size": {"longest_edge": 32}, "resample": 3},
                    {"size": {"longest_edge": 60}, "max_image_size": {"longest_edge": 30}, "do_image_splitting": False}]


def _idefics_processor(family: str, settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    names = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
             "global_image_token": "<global-img>", "video_token": "<video>", "end_of_utterance_token":
             "<end_of_utterance>"} if family == "smolvlm" else {}
    tokenizer = _tokenizer(IDEFICS_TOKENS, names)
    if family == "idefics3":
        image_processor = transformers.Idefics3ImageProcessorPil(**settings)
        return image_processor, transformers.Idefics3Processor(image_processor, tokenizer, image_seq_len=2)
    image_processor = transformers.SmolVLMImageProcessorPil(**settings)
    # num2words (not installed) only words SmolVLM's video prompts
    from transformers.models.smolvlm import processing_smolvlm

    monkeypatch.setattr(processing_smolvlm, "num2words", getattr(processing_smolvlm, "num2words", None) or str)
    return image_processor, _no_videos(transformers.SmolVLMProcessor)(image_processor=image_processor, video_processor=None,
                                                                      tokenizer=tokenizer, image_seq_len=2)


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("settings", IDEFICS_SETTINGS)
def test_idefics3_and_smolvlm_tiles_and_text_equal_transformers(family: str, settings: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.runtime.media.tiles_idefics3 import idefics3_image

    image_processor, processor = _idefics_processor(family, settings, monkeypatch)
    record = _record(image_processor, IDEFICS_FIELDS)
    grids = set()
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        ours = idefics3_image(image, record, {"image_seq_len": 2})
        out = _compare(ours, processor, image, "<image>", "<image>")
        assert out["pixel_attention_mask"].all()  # one image: no padding
        rows_cols = image_processor(image, return_row_col_info=True)
        assert (ours.rows, ours.cols) == (rows_cols["rows"][0][0], rows_cols["cols"][0][0])
        # (not compared with transformers' get_number_of_image_patches: from the size alone it rounds the short side
        # differently from its own resize and disagrees with the processor's pixel_values, e.g. 3x4 for a 4x4 split)
        grids.add((ours.rows, ours.cols))
    assert len(grids) >= (1 if not record["do_image_splitting"] else 5)


def test_idefics3_longest_edge_is_clamped_and_bad_input_refused() -> None:
    from PIL import Image
    from transformers.models.idefics3 import image_processing_pil_idefics3 as hf

    from kvforge.runtime.media.tiles_idefics3 import idefics3_image, longest_edge_size

    for height, width, longest in [(10, 1000, 5000), (1000, 7, 84), (999, 1000, 8000), (3, 3, 4097), (1, 9999, 364)]:
        theirs = hf._resize_output_size_scale_below_upper_bound(
            *hf._resize_output_size_rescale_to_max_len(height, width, max_len=longest), max_len=hf.MAX_IMAGE_SIZE)
        assert longest_edge_size(height, width, longest) == theirs
    assert max(longest_edge_size(10, 1000, 5000)) == 4096  # transformers' 4k cap
    record = _record(transformers.Idefics3ImageProcessorPil(**IDEFICS_SETTINGS[0]), IDEFICS_FIELDS)
    with pytest.raises(InputError, match="5x0 pixels has no pixels"):
        idefics3_image(Image.new("RGB", (5, 0)), record, {})
    with pytest.raises(InputError, match="max_image_size.longest_edge is None"):
        idefics3_image(_image(0, 8, 8, "RGB"), {**record, "max_image_size": {}}, {})
    with pytest.raises(InputError, match="image_seq_len is 0"):
        idefics3_image(_image(0, 8, 8, "RGB"), record, {"image_seq_len": 0})


# --- 3. LlavaNextImageProcessor / LlavaOnevisionImageProcessor (anyres) --------------------------------------------

LLAVA_FIELDS = (*BASE_FIELDS, "do_center_crop", "crop_size", "image_grid_pinpoints", "do_pad")
NEXT_SETTINGS = [  # released llava-v1.6 layout at 1/12 size; a {height, width} size without centre crop
    ({"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28},
      "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]},
     {"patch_size": 7, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}),
    ({"size": {"height": 32, "width": 32}, "do_center_crop": False, "resample": 2,
      "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64], [96, 96], [32, 96]]},
     {"patch_size": 8, "vision_feature_select_strategy": "full", "num_additional_image_tokens": 0})]
ONEVISION_PINPOINTS = [[28 * i, 28 * j] for i in range(1, 4) for j in range(1, 4)]


@pytest.mark.parametrize("settings, prompt", NEXT_SETTINGS)
def test_llava_next_tiles_and_token_count_equal_transformers(settings: dict[str, Any], prompt: dict[str, Any]) -> None:
    from kvforge.runtime.media.tiles_llava_next import llava_next_image

    image_processor = transformers.LlavaNextImageProcessorPil(**settings)
    processor = transformers.LlavaNextProcessor(image_processor, _tokenizer(["<image>"]), **prompt)
    record = _record(image_processor, LLAVA_FIELDS)
    counts = set()
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        ours = llava_next_image(image, record, prompt)
        out = _compare(ours, processor, image, "<image>", "<image>")
        assert ours.size == tuple(out["image_sizes"][0]) == (height, width)
        assert len(ours.tiles) == ours.rows * ours.cols + 1
        assert processor._get_num_multimodal_tokens([(height, width)])["num_image_tokens"] == [ours.image_tokens]
        counts.add(ours.image_tokens)
    assert len(counts) >= 5  # unpadding does vary with the aspect ratio


@pytest.mark.parametrize("most", ["anyres_max_9", "anyres_max_2"])
def test_llava_onevision_tiles_and_token_count_equal_transformers(most: str) -> None:
    from kvforge.runtime.media.tiles_llava_next import llava_next_image

    image_processor = transformers.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                                   image_grid_pinpoints=ONEVISION_PINPOINTS)
    prompt = {"num_image_tokens": 16, "vision_feature_select_strategy": "full", "vision_aspect_ratio": most}
    processor = _no_videos(transformers.LlavaOnevisionProcessor)(image_processor=image_processor,
                                                                 tokenizer=_tokenizer(["<image>", "<video>"]), **prompt)
    record = _record(image_processor, LLAVA_FIELDS)
    counts = set()
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        ours = llava_next_image(image, record, prompt, onevision=True)
        _compare(ours, processor, image, "<image>", "<image>")
        counts.add(ours.image_tokens)
    assert len(counts) >= 5
    # two images in one prompt: each is padded to a square in image_mean and is one tile of num_image_tokens + 1
    images = [_image(1, 90, 70, "RGBA"), _image(2, 40, 300, "RGB")]
    ours = [llava_next_image(one, record, prompt, onevision=True, whole=True) for one in images]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[images], text=["<image> and <image>"], return_text_replacement_offsets=True)
    theirs = np.asarray(out["pixel_values"])
    assert [one["replacement"] for one in out["text_replacement_offsets"][0]] == [one.text for one in ours]
    assert [len(one.tiles) for one in ours] == [1, 1] and ours[0].image_tokens == 17
    for i, one in enumerate(ours):
        np.testing.assert_array_equal(one.tiles[0], theirs[i, 0])


def test_llava_next_bad_input_is_one_input_error() -> None:
    from PIL import Image

    from kvforge.runtime.media.tiles_llava_next import llava_next_image

    settings, prompt = NEXT_SETTINGS[0]
    record = _record(transformers.LlavaNextImageProcessorPil(**settings), LLAVA_FIELDS)
    with pytest.raises(InputError, match="0x0 pixels has no pixels"):
        llava_next_image(Image.new("RGB", (0, 0)), record, prompt)
    with pytest.raises(InputError, match="image_grid_pinpoints is 7"):
        llava_next_image(_image(0, 9, 9, "RGB"), {**record, "image_grid_pinpoints": 7}, prompt)
    with pytest.raises(InputError, match="has no resolution"):
        llava_next_image(_image(0, 9, 9, "RGB"), {**record, "image_grid_pinpoints": []}, prompt)
    with pytest.raises(InputError, match="vision_aspect_ratio is 'anyres'"):
        llava_next_image(_image(0, 9, 9, "RGB"), record, {"num_image_tokens": 16, "vision_aspect_ratio": "anyres"},
                         onevision=True)


# --- 4. PixtralImageProcessor (Pixtral, Mistral 3) ----------------------------------------------------------------

PIXTRAL_FIELDS = (*BASE_FIELDS, "patch_size")
PIXTRAL_SETTINGS = [({"size": {"longest_edge": 64}, "patch_size": {"height": 8, "width": 8}},
                     {"patch_size": 8, "spatial_merge_size": 1}),  # Pixtral
                    ({"size": {"longest_edge": 100}, "patch_size": {"height": 7, "width": 7}},
                     {"patch_size": 7, "spatial_merge_size": 2})]  # Mistral 3: a token per 2x2 merged patches


def _pixtral_processor_class(monkeypatch: pytest.MonkeyPatch) -> type:
    """transformers' PixtralProcessor without torchvision: its top-level name is a placeholder (the class is marked
    as needing torchvision, which it does not use), and its module imports get_resize_output_image_size from the
    torchvision image processor's module; the PIL backend's module has the same function."""
    import sys
    import types

    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    name = "transformers.models.pixtral.image_processing_pixtral"
    if name not in sys.modules:
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.get_resize_output_image_size = pil.get_resize_output_image_size
            monkeypatch.setitem(sys.modules, name, stub)
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


@pytest.mark.parametrize("settings, prompt", PIXTRAL_SETTINGS)
def test_pixtral_image_and_text_equal_transformers(settings: dict[str, Any], prompt: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.runtime.media.tiles_pixtral import pixtral_image

    image_processor = transformers.PixtralImageProcessorPil(**settings)
    tokenizer = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    PixtralProcessor = _pixtral_processor_class(monkeypatch)

    processor = PixtralProcessor(image_processor, tokenizer, **prompt)
    record = _record(image_processor, PIXTRAL_FIELDS)
    compared, refused = 0, 0
    for seed, (height, width, mode) in enumerate(ALL_IMAGES):
        image = _image(seed, height, width, mode)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                processor(images=[image], text=["[IMG]"])
        except ValueError:  # transformers fails on an image scaled to a side of 0 pixels: kvforge refuses it
            with pytest.raises(InputError, match="has a side under one pixel"):
                pixtral_image(image, record, prompt)
            refused += 1
            continue
        ours = pixtral_image(image, record, prompt)
        out = _compare(ours, processor, image, "[IMG]", "[IMG]")
        assert ours.size == tuple(out["image_sizes"][0])
        assert ours.text.count("[IMG_BREAK]") == ours.rows - 1 and ours.text.endswith("[IMG_END]")
        predicted = processor._get_num_multimodal_tokens([(height, width)])["num_image_tokens"]
        assert predicted == [ours.image_tokens + ours.rows]  # transformers counts the breaks and the end too
        compared += 1
    assert compared >= 20 and refused <= 3


def test_pixtral_bad_input_is_one_input_error() -> None:
    from PIL import Image

    from kvforge.runtime.media.tiles_pixtral import pixtral_image

    settings, prompt = PIXTRAL_SETTINGS[0]
    record = _record(transformers.PixtralImageProcessorPil(**settings), PIXTRAL_FIELDS)
    with pytest.raises(InputError, match="1x0 pixels has no pixels"):
        pixtral_image(Image.new("RGB", (1, 0)), record, prompt)
    with pytest.raises(InputError, match="a 4000x1 image scaled to fit 64x64 pixels has a side under one pixel"):
        pixtral_image(_image(0, 1, 4000, "RGB"), record, prompt)
    with pytest.raises(InputError, match="spatial_merge_size is 0"):
        pixtral_image(_image(0, 9, 9, "RGB"), record, {**prompt, "spatial_merge_size": 0})
