"""Idefics3 (Idefics3ForConditionalGeneration) and SmolVLM (SmolVLMForConditionalGeneration; Granite-Docling is one)
exported whole, their images split as released: Idefics3ImageProcessor / SmolVLMImageProcessor resize an image's
longest edge, cut it into squares of max_image_size and add the whole image resized to one square
(runtime/media/tiles_idefics3.py); the SigLIP-like tower and the pixel-shuffle connector run on the tiles as one batch
(vision.onnx over a dynamic number of tiles); Idefics3Processor / SmolVLMProcessor write, per tile,
"<fake_token_around_image><row_R_col_C>" and image_seq_len "<image>" tokens, then the global image's
"<fake_token_around_image><global-img>", its tokens and "<fake_token_around_image>".

The two types' modeling code is the same (SmolVLM's is generated from Idefics3's); their text models are Llama
(registry.py's llama, read from the checkpoint's `model.text_model.`, exporter/text_model.py). Their processors differ
only in where the tokens' spellings come from: Idefics3Processor's are fixed, SmolVLMProcessor reads them off its
tokenizer. models/vision_families.py holds the rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.families.processor_settings import processor_settings, tokenizer_names

MODEL_TYPE = "idefics3"
FAMILIES: tuple = ()  # the text model is registry.py's llama
TILING = "idefics3"
# The image processor's fields its tiling reads beyond the common ones (exporter/vision.py PROCESSOR_FIELDS).
PROCESSOR_FIELDS = ("do_image_splitting", "max_image_size")
# The Processor's spellings of its tokens (transformers 5.24: fixed in Idefics3Processor; SmolVLMProcessor's
# fallbacks where its tokenizer names none).
TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
          "global_image_token": "<global-img>"}


def tokens_per_tile(config: Any) -> int:
    """The image tokens a tile gives: the tower's patches of a full tile, pixel-shuffled by scale_factor (transformers'
    Idefics3Model.image_seq_len)."""
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor ** 2)


def prompt_record(model_dir: Path, config: Any) -> dict[str, Any]:
    """The Processor's settings for an image's text (runtime/media/tiles_idefics3.py idefics3_image): image_seq_len
    from processor_config.json (the model's own count where it has none: the class's default, 169, is right only for
    Idefics3-8B's shape) and the three tokens' spellings."""
    want = tokens_per_tile(config)
    settings = processor_settings(model_dir, {"image_seq_len": want})
    if settings["image_seq_len"] != want:
        raise UnsupportedModelError(
            f"{model_dir}: processor_config.json's image_seq_len is {settings['image_seq_len']!r}, but the model gives "
            f"{want} image features a tile ((image_size / patch_size)^2 / scale_factor^2): its processor would write "
            "a prompt the model cannot fill; fix image_seq_len")
    names = dict(TOKENS) if config.model_type == "idefics3" else tokenizer_names(model_dir, TOKENS)
    return {**names, "image_seq_len": want}


def image_features(model: Any, pixel_values: Any) -> Any:
    """[tiles * image_seq_len, hidden]: the tiles' features in the order given, as transformers' get_image_features
    makes them for one image's tiles, each a full tile (the processor pads none of one image's tiles, so the pixel
    mask is all ones and the tower takes its own default, every patch): the tower's last hidden state, pixel-shuffled
    and projected by the connector. (transformers also drops a tile whose values are all exactly 0, taking it for batch
    padding; with the released mean and std, 0.5, no uint8 tile normalises to all zeros.)"""
    inner = model.model
    hidden = inner.vision_model(pixel_values=pixel_values.to(inner.dtype), return_dict=True).last_hidden_state
    out = inner.connector(hidden)
    return out.reshape(-1, out.shape[-1])

