"""LLaVA-NeXT (LlavaNextForConditionalGeneration) and LLaVA-OneVision (LlavaOnevisionForConditionalGeneration)
exported whole, their images tiled "anyres": the image processor resizes an image into the best of
image_grid_pinpoints and cuts it into tiles after a base tile of the whole image (runtime/media/tiles_llava_next.py),
the tower and projector run on the tiles as one batch (vision.onnx over a dynamic number of tiles, with the model's
image_newline as a second output), and the runtime arranges the tiles' features as the model's pack_image_features
does (the grid unpadded to the image's aspect, image_newline after each row, OneVision's grid pooled down past its
anyres_max budget: runtime/media/llava_next_pack.py), since that arrangement follows each image's size.

models/vision_families.py holds the rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.families.processor_settings import processor_settings, tokenizer_names

FAMILIES: tuple = ()  # the text model is a registry family of its own type (Llama, Mistral, Qwen2, ...)
NEXT, ONEVISION = "llava_next", "llava_onevision"
# The image processor's fields the tiling reads beyond the common ones (exporter/vision.py PROCESSOR_FIELDS).
PROCESSOR_FIELDS = ("image_grid_pinpoints",)
EXTRA_OUTPUTS = ("image_newline",)


def image_features(model: Any, pixel_values: Any) -> tuple[Any, Any]:
    """(features [tiles * tokens_per_tile, hidden], image_newline [hidden]) of one image's tiles [tiles, C, H, W]:
    get_image_features up to its pack (the tower's vision_feature_layer(s), the CLS dropped by the "default"
    strategy, the projector), tile by tile in the order given; the pack is the runtime's."""
    import torch

    inner, config = model.model, model.config
    out = inner.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
    layer = config.vision_feature_layer
    if isinstance(layer, int):
        selected = out.hidden_states[layer]
    else:
        selected = torch.cat([out.hidden_states[i] for i in layer], dim=-1)
    if config.vision_feature_select_strategy == "default":
        selected = selected[:, 1:]
    features = inner.multi_modal_projector(selected)
    return features.reshape(-1, features.shape[-1]), inner.image_newline


def patches_per_side(config: Any) -> int:
    """A tile's patches along each side: the model's pack takes a tile's features as this square."""
    vision = config.vision_config
    return int(vision.image_size) // int(vision.patch_size)


def _check_strategy(config: Any, strategy: Any) -> None:
    """The model's pack reshapes a tile's features into its patch square: a tower with a CLS token must drop it
    ("default"), one without must keep all ("full"); the processor's count must follow the model's strategy."""
    if strategy != config.vision_feature_select_strategy:
        raise UnsupportedModelError(
            f"{config.model_type}: processor_config.json's vision_feature_select_strategy {strategy!r} is not the "
            f"model's {config.vision_feature_select_strategy!r}, so its prompts would not hold the model's image "
            "features; make them agree")
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"{config.model_type}: vision_feature_select_strategy {strategy!r} is neither "
                                    "\"default\" nor \"full\"")


def prompt_record(model_dir: Path, config: Any) -> dict[str, Any]:
    """LlavaNextProcessor's (LlavaOnevisionProcessor's) settings for an image's text (tiles_llava_next.py
    llava_next_image): processor_config.json's, with the class's defaults; where the class's default is None (a
    checkpoint saved before the setting existed) the model's own value."""
    side = patches_per_side(config)
    if config.model_type == ONEVISION:
        defaults = {"num_image_tokens": side * side, "vision_feature_select_strategy": None,
                    "vision_aspect_ratio": "anyres_max_9", "image_token": "<image>"}
    else:
        defaults = {"patch_size": None, "vision_feature_select_strategy": None, "num_additional_image_tokens": 0,
                    "image_token": "<image>"}
    settings = processor_settings(model_dir, defaults)
    if settings.get("patch_size", 0) is None:
        settings["patch_size"] = int(config.vision_config.patch_size)
    if settings["vision_feature_select_strategy"] is None:
        settings["vision_feature_select_strategy"] = config.vision_feature_select_strategy
    _check_strategy(config, settings["vision_feature_select_strategy"])
    if config.model_type == ONEVISION and settings["num_image_tokens"] != side * side:
        raise UnsupportedModelError(f"{config.model_type}: processor_config.json's num_image_tokens "
                                    f"{settings['num_image_tokens']} is not the tower's {side * side} a tile")
    model_aspect = getattr(config, "vision_aspect_ratio", None)
    if config.model_type == ONEVISION and settings["vision_aspect_ratio"] != model_aspect:
        raise UnsupportedModelError(f"{config.model_type}: processor_config.json's vision_aspect_ratio "
                                    f"{settings['vision_aspect_ratio']!r} is not the model's {model_aspect!r}, so its "
                                    "prompts would not hold the model's pooled features; make them agree")
    settings["image_token"] = tokenizer_names(model_dir, {"image_token": settings["image_token"]})["image_token"]
    return settings
