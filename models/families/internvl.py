"""InternVL (InternVLForConditionalGeneration) exported whole, its images tiled as released: GotOcr2ImageProcessor
with crop_to_patches cuts an image into a grid of tiles nearest its aspect ratio plus a thumbnail
(runtime/media/tiles_got_ocr2.py), the tower and projector run on the tiles as one batch (vision.onnx over a dynamic
number of tiles), and InternVLProcessor writes "<img>", image_seq_length context tokens a tile and "</img>".

InternVLProcessor tiles whatever the image processor's own crop_to_patches says (its call passes
crop_to_patches=True), so the export does too. models/vision_families.py holds the row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.models.families.processor_settings import processor_settings, tokenizer_names

FAMILIES: tuple = ()  # the text model is a registry family of its own type (Qwen2, Llama, ...)
TILING = "internvl"
# The image processor's fields its tiling reads beyond the common ones (exporter/vision.py PROCESSOR_FIELDS).
PROCESSOR_FIELDS = ("min_patches", "max_patches")
TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}


def tokens_per_tile(config: Any) -> int:
    """The context tokens a tile gives: its patches, pixel-shuffled by downsample_ratio (InternVL's projector)."""
    vision = config.vision_config
    side = vision.image_size[0] if isinstance(vision.image_size, list | tuple) else vision.image_size
    patch = vision.patch_size[0] if isinstance(vision.patch_size, list | tuple) else vision.patch_size
    return int((side // patch) ** 2 * config.downsample_ratio ** 2)


def prompt_record(model_dir: Path, config: Any) -> dict[str, Any]:
    """InternVLProcessor's settings for an image's text (runtime/media/tiles_got_ocr2.py internvl_image)."""
    names = tokenizer_names(model_dir, TOKENS)
    settings = processor_settings(model_dir, {"image_seq_length": tokens_per_tile(config)})
    return {**names, **settings, "crop_to_patches": True, "image_token": names["context_image_token"]}
