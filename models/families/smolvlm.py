"""SmolVLM (SmolVLMForConditionalGeneration; Granite-Docling's class too): Idefics3's family under its own model_type.
transformers generates SmolVLM's modeling and image processor from Idefics3's, so models/families/idefics3.py holds
both; this module names it for the row of models/vision_families.py that imports a tiled family by its type."""

from __future__ import annotations

from kvforge.models.families.idefics3 import PROCESSOR_FIELDS, TILING, image_features, prompt_record  # noqa: F401

FAMILIES: tuple = ()  # the text model is registry.py's llama
