"""The vision-language families kvforge exports whole: the image tower and projector as `vision.onnx` beside the
text model's prefill and decode graphs.

A row per checkpoint type (LLaVA, ...): how its image features are computed (transformers' own
`get_image_features`, traced), which token id stands for an image feature in the prompt, and what surrounds an
image's run of those tokens. The image processor's pipeline is recorded in the manifest as transformers resolved it
and replayed without torch by the runtime (runtime/media/preprocess.py), which says which processors it reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The text that stands for one image in a prompt, as Hugging Face's processors spell it for these families.
IMAGE_PLACEHOLDER = "<image>"


def image_features(model: Any, pixel_values: Any) -> Any:
    """[tokens, hidden]: transformers' own image features of one image (the family's get_image_features: tower,
    feature layer and projector), image tokens in prompt order."""
    import torch

    out = model.model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
    if isinstance(out, list | tuple):
        return torch.cat(list(out), 0)
    return out.reshape(-1, out.shape[-1])


def image_token_id(config: Any) -> int:
    """The id that marks an image feature's position among the input ids (its two spellings in transformers)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"{config.model_type}: the config names no image token id")


def janus_prompt_prefix(settings: dict[str, Any]) -> str:
    """JanusProcessor's DEFAULT_SYSTEM_PROMPT where its settings turn it on (it adds it in __call__, outside the chat
    template, to text prompts)."""
    if settings.get("use_default_system_prompt") is not True:
        return ""
    from transformers.models.janus.processing_janus import DEFAULT_SYSTEM_PROMPT

    return DEFAULT_SYSTEM_PROMPT


@dataclass(frozen=True)
class VisionFamily:
    """What exporting one vision-language type whole needs. `features(model, pixel_values [1, C, H, W])` gives the
    image's token embeddings [tokens, hidden]; `before` / `after` the tokenizer's tokens around an image's run of
    image tokens, as the family's processor writes them (none for LLaVA)."""

    model_type: str
    features: Callable[[Any, Any], Any] = image_features
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    placeholder: str = IMAGE_PLACEHOLDER
    # The text the family's chat templates write for an image content part, which its Hugging Face processor expands
    # into `before`, the image tokens and `after` (LLaVA's templates write "<image>", InternVL's "<IMG_CONTEXT>", ...).
    chat_placeholder: str = IMAGE_PLACEHOLDER
    # The text its processor puts before every text prompt, from the processor's settings (processor_config.json as a
    # dict): Janus's default system prompt, when `use_default_system_prompt` is set (the released checkpoints set it).
    prompt_prefix: Callable[[dict[str, Any]], str] | None = None
    # Text-config values that make its text model compute what the whole model does (Aya Vision's class applies no
    # Cohere 2 logit_scale to its head's output): every export of the checkpoint, --text-only too, and parity's
    # reference follow the whole model.
    text_overrides: tuple[tuple[str, Any], ...] = ()
    # Its tower takes each image at its own size, as patches (Qwen2-VL's: exporter/vision_patches.py), so an image's
    # token count follows its size; its text model then takes multimodal positions (Family.mrope).
    patches: bool = False
    # How many text layers add each image token's features of a further tower stage (Qwen3-VL's DeepStack): its
    # features row holds them after its embedding, and the prefill graph adds them (from the checkpoint's config).
    deepstack: Callable[[Any], int] | None = None
    # Text the processor writes around an image's tokens that it tokenizes with the prompt's text (Gemma 3's "\n\n"):
    # the runtime adds it to the text pieces around a placeholder before tokenizing them.
    text_before: str = ""
    text_after: str = ""
    # An image's tokens attend to each other both ways in prefill (Gemma 3): the fused op's block ids
    # (exporter/image_blocks.py), and the runtime keeps each image's block inside one prefill call.
    bidirectional_images: bool = False
    # An image cut into tiles by its processor (InternVL, Aya Vision, ...): the runtime's tiling of that name
    # (runtime/media/tiling.py TILINGS) makes the tiles and the image's text; vision.onnx takes the tiles as one batch
    # ([tiles, C, H, W]; `features` gives their rows in the text's order). `prompt_record(model_dir, config)`: the
    # Processor's settings the tiling reads, with `image_token` the text of the image (feature) token;
    # `processor_fields`: the image processor's fields it reads beyond PROCESSOR_FIELDS (exporter/vision.py).
    tiling: str = ""
    prompt_record: Callable[[Any, Any], dict[str, Any]] | None = None
    processor_fields: tuple[str, ...] = ()
    # The runtime's arrangement of a tiled image's feature rows (runtime/media/tiling.py PACKS; "" = as they come),
    # and the vision graph's outputs it reads beside them (contract.VISION_EXTRA_OUTPUTS): `features` then returns
    # (features, *extras).
    pack: str = ""
    extra_outputs: tuple[str, ...] = ()


def _gemma3_row() -> VisionFamily:
    from kvforge.models.families import gemma3

    return VisionFamily(gemma3.MODEL_TYPE, gemma3.image_features, before=gemma3.BEFORE, after=gemma3.AFTER,
                        placeholder=gemma3.PLACEHOLDER, chat_placeholder=gemma3.PLACEHOLDER,
                        text_before=gemma3.IMAGE_TEXT_BEFORE, text_after=gemma3.IMAGE_TEXT_AFTER,
                        bidirectional_images=True)


def _tiled_row(model_type: str, **fields: Any) -> VisionFamily:
    """A family whose images are tiled (its module in models/families/ names its tiling and prompt record)."""
    import importlib

    module = importlib.import_module(f"kvforge.models.families.{model_type}")
    return VisionFamily(model_type, tiling=module.TILING, prompt_record=module.prompt_record,
                        processor_fields=module.PROCESSOR_FIELDS, **fields)


def _idefics3_features(model: Any, pixel_values: Any) -> Any:
    from kvforge.models.families.idefics3 import image_features as features

    return features(model, pixel_values)


def _llava_next_row(model_type: str) -> VisionFamily:
    """LLaVA-NeXT / OneVision: tiled "anyres", the tiles' rows packed by the image's size with image_newline."""
    from kvforge.models.families import llava_next

    return VisionFamily(model_type, llava_next.image_features, tiling=model_type, pack=model_type,
                        prompt_record=llava_next.prompt_record, processor_fields=llava_next.PROCESSOR_FIELDS,
                        extra_outputs=llava_next.EXTRA_OUTPUTS)


def _deepstack_layers(config: Any) -> int:
    from kvforge.models.families.qwen_vl import deepstack_layers

    return deepstack_layers(config)


VISION_FAMILIES: dict[str, VisionFamily] = {
    family.model_type: family for family in (
        VisionFamily("llava"),
        VisionFamily("vipllava"),
        VisionFamily("video_llava"),
        # Tiled as released (models/families/internvl.py): "<img>", a tile's context tokens for each tile, "</img>".
        _tiled_row("internvl", chat_placeholder="<IMG_CONTEXT>"),
        # Its processor expands only "<imgpad>": a chat template writes the "<img>" ... "</img>" around it.
        VisionFamily("got_ocr2", before=("<img>",), after=("</img>",), chat_placeholder="<img><imgpad></img>"),
        # Tiled as released (models/families/aya_vision.py); its chat templates write the processor's "<image>".
        _tiled_row("aya_vision", text_overrides=(("logit_scale", 1.0),)),
        VisionFamily("deepseek_vl", chat_placeholder="<image_placeholder>"),
        VisionFamily("janus", before=("<begin_of_image>",), after=("<end_of_image>",),
                     chat_placeholder="<image_placeholder>", prompt_prefix=janus_prompt_prefix),
        _gemma3_row(),
        # Split as released (models/families/idefics3.py; SmolVLM's code is Idefics3's): per tile a fake token, its
        # row/column tag and its image tokens, then the global image's; prompts and chat templates write "<image>".
        *(_tiled_row(name, features=_idefics3_features) for name in ("idefics3", "smolvlm")),
        # Tiled "anyres" (models/families/llava_next.py): the runtime packs the tiles' rows by the image's size.
        *(_llava_next_row(name) for name in ("llava_next", "llava_onevision")),
        # Qwen's processor expands only "<|image_pad|>": its chat template writes "<|vision_start|>" ... around it.
        *(VisionFamily(name, before=("<|vision_start|>",), after=("<|vision_end|>",), patches=True,
                       chat_placeholder="<|vision_start|><|image_pad|><|vision_end|>",
                       deepstack=_deepstack_layers if name == "qwen3_vl" else None)
          for name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")),
    )
}


def vision_family(model_type: Any) -> VisionFamily | None:
    """The row of a vision-language type kvforge exports whole, or None (a text model, or a multimodal checkpoint
    whose text model alone is exported)."""
    return VISION_FAMILIES.get(model_type) if isinstance(model_type, str) else None
