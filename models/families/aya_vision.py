"""Aya Vision (AyaVisionForConditionalGeneration) exported whole, its images tiled as released: GotOcr2ImageProcessor
with crop_to_patches (runtime/media/tiles_got_ocr2.py), the SigLIP tower and pixel-shuffle projector run on the tiles
as one batch, and AyaVisionProcessor writes the start token, each tile's marker and patch tokens, the global tile's
and the end token. Its text model is Cohere 2 with no logit_scale applied (the row's text_overrides).

AyaVisionProcessor tiles whatever the image processor's own crop_to_patches says, so the export does too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.models.families.processor_settings import processor_settings

FAMILIES: tuple = ()  # the text model is registry.py's cohere2
TILING = "aya_vision"
PROCESSOR_FIELDS = ("min_patches", "max_patches")
# AyaVisionProcessor's own defaults (transformers 5.24, processing_aya_vision.py).
DEFAULTS = {"patch_size": 28, "img_size": 364, "downsample_factor": 1, "start_of_img_token": "<|START_OF_IMG|>",
            "end_of_img_token": "<|END_OF_IMG|>", "img_patch_token": "<|IMG_PATCH|>",
            "img_line_break_token": "<|IMG_LINE_BREAK|>", "tile_token": "TILE", "tile_global_token": "TILE_GLOBAL"}


def prompt_record(model_dir: Path, config: Any) -> dict[str, Any]:
    """AyaVisionProcessor's settings for an image's text (runtime/media/tiles_got_ocr2.py aya_vision_image)."""
    settings = processor_settings(model_dir, DEFAULTS)
    return {**settings, "crop_to_patches": True, "image_token": settings["img_patch_token"]}
