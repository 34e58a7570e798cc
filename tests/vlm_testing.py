"""What the vision-language tests share: a seeded random RGB picture, and a transformers Processor class that takes
no video processor (transformers' video processors need torchvision, which is not installed here)."""

from __future__ import annotations

from typing import Any

import numpy as np


def rgb_image(seed: int, height: int, width: int) -> Any:
    """A PIL RGB image of seeded noise."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8), "RGB")


def no_videos(cls: type) -> type:
    """`cls` (a Processor class) taking no video processor."""
    class NoVideos(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return NoVideos


def tiny_vlm_export(tmp_path_factory: Any, family: str) -> Any:
    """A folder holding `hf/` (the family's tiny seeded checkpoint, kvforge/tools/vlm_fixtures.py) and `export/` (its
    fp32 `ort` export), made once per test run and shared by the xdist workers: read-only (copy before editing)."""
    from shared_exports import made_once, shared_folder

    def make(out: Any) -> None:
        from kvforge.exporter.export import export_model
        from kvforge.tools.vlm_fixtures import build_tiny_vlm

        out.mkdir()
        build_tiny_vlm(family, out / "hf")
        export_model(out / "hf", out / "export", target="ort")

    return made_once(shared_folder(tmp_path_factory, "tiny-vlm"), family, make)


def load_tiny_vlm(hf_dir: Any) -> Any:
    """The tiny checkpoint's Hugging Face model (its ForConditionalGeneration class, eager attention, eval mode), as
    build_tiny_vlm returned it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = getattr(transformers, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[config.model_type])
    return cls.from_pretrained(hf_dir, attn_implementation="eager").eval()
