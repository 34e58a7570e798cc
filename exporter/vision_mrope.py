"""The manifest `vision` record of a tower that takes images at their own size (Qwen2-VL, Qwen2.5-VL), made at export:
its processor's fields as transformers resolved them, the config's M-RoPE and tower sizes, and the arrays the traced
tower takes beside the patches (exporter/vision_patches.py). The runtime replays them without torch
(runtime/media/qwen_vl_preprocess.py, runtime/media/mrope.py); kvforge/core/vision_manifest.py checks them at load.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.models.families.qwen_vl import VIDEO_TYPES, mrope_record

# The processor attributes the runtime reads (besides class, backend, min_pixels and max_pixels).
FIELDS = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
          "image_std", "patch_size", "temporal_patch_size", "merge_size")
VIDEO_FIELDS = ("cap_pixels_per_frame", "max_video_tokens", "do_sample_frames", "fps", "num_frames", "min_frames",
                "max_frames")
VIDEO_CLASSES = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")


def _plain(value: Any) -> Any:
    """A JSON-able copy: tuples to lists, enums and numpy scalars to int/float."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | np.integer) or hasattr(value, "value") and isinstance(value.value, int):
        return int(getattr(value, "value", value))
    return float(value)


def qwen_processor_record(processor: Any) -> dict[str, Any]:
    """The fields of a transformers Qwen2-VL-style image or video processor (as 5.24 resolved its config: min_pixels
    and max_pixels are size's shortest_edge and longest_edge) that preprocess_qwen / preprocess_qwen_video read."""
    size = processor.size
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    record: dict[str, Any] = {"class": type(processor).__name__,
                              "backend": str(getattr(processor, "backend", "torchvision")),
                              "min_pixels": get("shortest_edge") or get("min_pixels"),
                              "max_pixels": get("longest_edge") or get("max_pixels")}
    video = record["class"] in VIDEO_CLASSES
    for field in FIELDS + (VIDEO_FIELDS if video else ()):
        record[field] = _plain(getattr(processor, field, None))
    if video:
        record["backend"] = "torchvision"  # transformers' video processors have no PIL backend
    return record


def image_processor_record(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's image processor, in its PIL form (the runtime's Pillow pipeline is that one's)."""
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
        except (OSError, ValueError) as err:
            raise InputError(f"{model_dir}: its image processor could not be read ({err}); a vision-language export "
                             "needs it: pass the complete checkpoint folder, or export with --text-only") from None
    return qwen_processor_record(processor)


def patch_vision_fields(model: Any, tower_inputs: tuple[str, ...], deepstack: int = 0) -> dict[str, Any]:
    """The record's fields of a patch tower (merged into exporter/vision.py's vision_record). With DeepStack layers,
    an image token's features row holds them after its embedding: `hidden_size` is the row's width."""
    hidden = int(model.get_input_embeddings().weight.shape[-1])
    return {"input": "patches", "positions": "mrope", "mrope": mrope_record(model.config),
            "tower_inputs": list(tower_inputs), "tokens_per_image": None, "image_size": None,
            "hidden_size": hidden * (1 + deepstack), **({"deepstack": deepstack} if deepstack else {})}


# Qwen2VLVideoProcessor's own pixel bounds (transformers 5.24), where the folder's config names none.
VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)


def video_processor_record(model_dir: Path, image_record: dict[str, Any], model_type: str) -> dict[str, Any] | None:
    """The checkpoint's video processor (Qwen2-VL / Qwen2.5-VL; None for a family whose videos the runtime does not
    take: Qwen3-VL writes timestamps between frame groups). transformers' video processors need torchvision; without
    it the record is made as they resolve their config: video_preprocessor_config.json, else preprocessor_config.json
    (the image processor's file), over the class's pixel bounds, with the image processor's other fields."""
    import json

    if model_type not in VIDEO_TYPES:
        return None
    try:
        from transformers import AutoVideoProcessor

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return qwen_processor_record(AutoVideoProcessor.from_pretrained(model_dir, local_files_only=True))
    except (ImportError, OSError, ValueError):
        pass
    saved: dict[str, Any] = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (model_dir / name).is_file():
            saved = json.loads((model_dir / name).read_text(encoding="utf-8"))
            break
    size = saved.get("size") if isinstance(saved.get("size"), dict) else {}
    low = saved.get("min_pixels") or size.get("shortest_edge") or VIDEO_PIXELS[0]
    high = saved.get("max_pixels") or size.get("longest_edge") or VIDEO_PIXELS[1]
    return {**image_record, "class": "Qwen2VLVideoProcessor", "backend": "torchvision", "min_pixels": int(low),
            "max_pixels": int(high), "cap_pixels_per_frame": False, "max_video_tokens": None,
            "do_sample_frames": False, "fps": float(saved.get("fps") or 2.0), "num_frames": None, "min_frames": None,
            "max_frames": None}
