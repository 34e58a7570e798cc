"""The third graph of a vision-language export, `vision.onnx`: one preprocessed image in, its image tokens'
embeddings out (the family's tower, feature selection and projector, traced from transformers' own modules).

The prefill graph takes those embeddings at the image tokens' positions (contract.IMAGE_FEATURES,
exporter/wrapper.py merge_image_features); decode is unchanged. What the runtime needs to make an image's input
and prompt without torch (the processor's pipeline as transformers resolved it, the image token, its count, the
ids around an image) is the manifest's `vision` record, made here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as io_module
import warnings
from pathlib import Path
from typing import Any

from kvforge.core.contract import IMAGE_FEATURES, IMAGE_PROCESSORS, PIXEL_VALUES
from kvforge.core.errors import InputError, UnsupportedModelError
from kvforge.models.families.gemma3 import refuse_pan_and_scan
from kvforge.models.vision_families import VisionFamily, image_token_id

# The image processor fields the runtime replays (runtime/media/preprocess.py), as transformers resolved them.
PROCESSOR_FIELDS = ("do_convert_rgb", "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
                    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_pad", "min_size",
                    "background_color", "crop_to_patches")


def load_vision_language_model(model_dir: Path, dtype: str) -> Any:
    """The checkpoint's class (`...ForConditionalGeneration`) with eager attention, in eval mode, for its tower and
    projector (traced into vision.onnx): built with a one-layer text model, so that only the tower, the
    projector, the embeddings, the head and the text model's first layer are read (the text graphs come from the
    whole text model, loaded on its own)."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    from kvforge.core.contract import DTYPES

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    text = config.text_config
    text.num_hidden_layers = 1
    for name in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the layer count
        if isinstance(getattr(text, name, None), list):
            setattr(text, name, getattr(text, name)[:1])
    cls = getattr(transformers, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[config.model_type])
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the text model's other layers are "unused weights" here, on purpose
    try:
        model = cls.from_pretrained(model_dir, config=config, dtype=getattr(torch, DTYPES[dtype]),
                                    attn_implementation="eager", local_files_only=True, use_safetensors=True,
                                    trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()


def checkpoint_image_token(model_dir: Path) -> int:
    """The image token id of a checkpoint folder's config (what its prefill graph merges image features at)."""
    from transformers import AutoConfig

    return image_token_id(AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False))


def processor_record(model_dir: Path, family: VisionFamily | None = None) -> dict[str, Any]:
    """The checkpoint's image processor as transformers resolves it (preprocessor_config.json, or the
    "image_processor" entry of processor_config.json as transformers 5 saves a processor, with its class's defaults):
    its class name and PROCESSOR_FIELDS (and a tiled family's own fields), JSON-ready. A tiled family's tiling
    (runtime/media/tiling.py) checks its record; any other's must be a processor the runtime's pipeline replays."""
    from transformers import AutoImageProcessor

    if not (model_dir / "preprocessor_config.json").is_file() and not _has_image_processor_entry(model_dir):
        raise InputError(f"{model_dir} has no preprocessor_config.json (nor an image_processor entry in "
                         "processor_config.json): a vision-language export needs the image processor's settings; pass "
                         "the complete checkpoint folder, or export with --text-only")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    record: dict[str, Any] = {"class": type(processor).__name__.removesuffix("Pil").removesuffix("Fast")}
    tiled = family is not None and bool(family.tiling)
    for field in (*PROCESSOR_FIELDS, *(family.processor_fields if family is not None else ())):
        value = getattr(processor, field, None)
        if dataclasses.is_dataclass(value):  # transformers' SizeDict
            value = dataclasses.asdict(value)
        elif hasattr(value, "to_dict"):
            value = value.to_dict()
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        elif hasattr(value, "value"):  # an enum (resample)
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        record[field] = value
    if tiled:
        return record
    if record["class"] not in IMAGE_PROCESSORS:
        raise UnsupportedModelError(f"{model_dir}: its image processor {record['class']} is not one kvforge's runtime "
                                    f"reproduces without torch ({', '.join(IMAGE_PROCESSORS)}); export with --text-only")
    if getattr(processor, "do_pan_and_scan", None) is not None:  # Gemma 3's (only where a processor has it)
        record["do_pan_and_scan"] = bool(processor.do_pan_and_scan)
        refuse_pan_and_scan(record, str(model_dir))
    if record.get("crop_to_patches"):
        raise UnsupportedModelError(
            f"{model_dir}: its image processor tiles each image (crop_to_patches), and kvforge's image path takes one "
            "tile per image: set \"crop_to_patches\": false in preprocessor_config.json (or in processor_config.json's "
            "image_processor entry): each image is then resized to one tile, at some cost in detail; or export with "
            "--text-only")
    return record


def _processor_settings(model_dir: Path) -> dict[str, Any]:
    """processor_config.json (the processor's own settings, and in transformers 5's save_pretrained layout its image
    processor's under "image_processor"), {} where there is none."""
    import json

    path = model_dir / "processor_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not readable JSON ({err}); fix or remove it") from None
    return config if isinstance(config, dict) else {}


def _has_image_processor_entry(model_dir: Path) -> bool:
    """Whether processor_config.json holds the image processor's settings (transformers 5's save_pretrained layout)."""
    return isinstance(_processor_settings(model_dir).get("image_processor"), dict)


def image_shape(record: dict[str, Any], config: Any) -> tuple[int, int]:
    """(height, width) of the processor's output: its crop, else its fixed size, else the tower's image size."""
    for on, field in (("do_center_crop", "crop_size"), ("do_resize", "size")):
        size = record.get(field) or {}
        if record.get(on) and "height" in size and "width" in size:
            return int(size["height"]), int(size["width"])
    side = getattr(getattr(config, "vision_config", None), "image_size", None)
    if not isinstance(side, int):
        raise UnsupportedModelError(f"{config.model_type}: its image processor gives no fixed image size, which "
                                    "vision.onnx needs")
    return side, side


def _features_module(model: Any, family: VisionFamily) -> Any:
    """A module: forward(pixel_values [1, C, H, W]) -> image features [tokens, hidden] (the family's `features`)."""
    import torch

    class Features(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            return family.features(self.model, pixel_values)

    return Features()


def output_shape(module: Any, example: Any) -> tuple[int, ...]:
    """The shape of `module(example)` (its first output): propagated with fake tensors, which compute nothing (an
    eager fp16 tower at a real size takes many minutes on a CPU); run for real where an op needs the values."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad():
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                out = module(mode.from_tensor(example))
        except Exception:  # noqa: BLE001 - a data-dependent op (a boolean mask's count): run it
            out = module(example)
    first = out[0] if isinstance(out, tuple) else out
    return tuple(int(d) for d in first.shape)


def trace_vision(model: Any, family: VisionFamily, shape: tuple[int, int], torch_dtype: Any) -> tuple[Any, int]:
    """vision.onnx (an onnx_ir model, one image per call) and the number of image tokens an image gives."""
    import torch

    from kvforge.core.progress import quiet_logger
    from kvforge.exporter.trace import OPSET

    channels = getattr(model.config.vision_config, "num_channels", 3)
    example = torch.zeros(1, channels, *shape, dtype=torch_dtype)
    wrapper = _features_module(model, family)
    tokens = int(output_shape(wrapper, example)[0])
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=[PIXEL_VALUES],
                                    output_names=[IMAGE_FEATURES], opset_version=OPSET, optimize=True, verbose=False)
    graph = program.model
    graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    return graph, tokens


def _token_ids(model_dir: Path, tokens: tuple[str, ...]) -> list[int]:
    """The ids of the family's tokens around an image in the checkpoint's tokenizer.json."""
    if not tokens:
        return []
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path)) if path.is_file() else None
    ids = [tokenizer.token_to_id(token) if tokenizer is not None else None for token in tokens]
    missing = [token for token, i in zip(tokens, ids, strict=True) if i is None]
    if missing:
        raise InputError(f"{model_dir}'s tokenizer.json lacks {', '.join(missing)}, which its processor writes around "
                         "an image; pass the checkpoint's own tokenizer")
    return [int(i) for i in ids]


def vision_record(model: Any, family: VisionFamily, processor: dict[str, Any], shape: tuple[int, int],
                  tokens: int, model_dir: Path) -> dict[str, Any]:
    """The manifest's `vision` section: what the runtime needs to turn an image and a prompt into the graphs'
    inputs (runtime/media/)."""
    config = model.config
    before, after = _token_ids(model_dir, family.before), _token_ids(model_dir, family.after)
    return {
        "family": family.model_type, "file": "vision.onnx", "image_token_id": image_token_id(config),
        "tokens_per_image": tokens, "hidden_size": int(model.get_input_embeddings().weight.shape[-1]),
        "image_size": list(shape), "channels": getattr(config.vision_config, "num_channels", 3),
        "placeholder": family.placeholder, "chat_placeholder": family.chat_placeholder, "before_ids": list(before),
        "after_ids": list(after),
        "prompt_prefix": family.prompt_prefix(_processor_settings(model_dir)) if family.prompt_prefix else "",
        "processor": processor,
        # Gemma 3's: text tokenized with the prompt around an image, and image blocks seen both ways (kept whole).
        **({"text_before": family.text_before, "text_after": family.text_after} if family.text_before
           or family.text_after else {}),
        **({"image_blocks": True} if family.bidirectional_images else {}),
    }
