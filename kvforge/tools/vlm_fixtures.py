"""Tiny seeded vision-language checkpoints (no hub): a family's whole model at test sizes, its image processor's
config and kvforge's built-in tokenizer, written as a Hugging Face folder. Test fixtures of the image path.

The text vocabulary is the tokenizer's 512 tokens plus IMAGE_TOKENS ids that the tokenizer never produces, so the
image token (and a family's tokens around an image) cannot be typed as text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXT_VOCAB = 512  # the built-in tokenizer's size
IMAGE_TOKEN_ID = TEXT_VOCAB + 8  # the image token of every tiny checkpoint
VOCAB_SIZE = TEXT_VOCAB + 16
SIDE = 56  # the images' side after preprocessing: 16 patches of 14 pixels

# Per family: the config's own fields, its sub-configs' overrides, the image processor it is saved with, and the
# tokens its processor writes around an image (added to the tokenizer as special tokens).
_CLIP = ("CLIPImageProcessor", {"size": {"shortest_edge": SIDE}, "crop_size": {"height": SIDE, "width": SIDE}})
_SQUARE = {"size": {"height": SIDE, "width": SIDE}}
_TOWER = {"num_hidden_layers": 2, "image_size": SIDE, "patch_size": 14}
# Qwen VL: the tokens around an image (ids TEXT_VOCAB, TEXT_VOCAB + 1 in the built-in tokenizer), and an image
# processor whose pixel bounds give images of 28..300 pixels different grids (4 to 144 patches of 14 pixels).
_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>")
_QWEN_IDS = {"image_token_id": IMAGE_TOKEN_ID, "video_token_id": IMAGE_TOKEN_ID + 1,
             "vision_start_token_id": TEXT_VOCAB, "vision_end_token_id": TEXT_VOCAB + 1}
# The towers' weights at the text model's scale (tiny_config's 0.2, not HF's 0.02): attention then depends on
# which patches it sees, so a wrong mask or window shows in the features.
_QWEN_INIT = {"initializer_range": 0.2}
_FILLER = tuple(f"<unused{i}>" for i in range(8))  # tokens that put a family's image token at IMAGE_TOKEN_ID
_QWEN_TOWER = {**_QWEN_INIT, "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
               "out_hidden_size": 64}
_QWEN_PROCESSOR = ("Qwen2VLImageProcessor", {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 36})
_NEXT_PINPOINTS = [[SIDE, 2 * SIDE], [2 * SIDE, SIDE], [2 * SIDE, 2 * SIDE], [3 * SIDE, SIDE], [SIDE, 3 * SIDE]]
_ONEVISION_PINPOINTS = [[SIDE * i, SIDE * j] for i in range(1, 4) for j in range(1, 4)]
_LLAVA_TOKENS = (*[f"<unused{i}>" for i in range(8)], "<image>", "<video>")
# Idefics3 / SmolVLM: tiles of 64 pixels (the tower's image_size), an image's longest edge resized to 128, so images
# split into 1x2, 2x1 or 2x2 tiles plus the global one (3 or 5 tiles); 16 image tokens a tile after the pixel
# shuffle (Idefics3: 8x8 patches / 2^2, SmolVLM: 16x16 / 4^2). The processor's tokens take ids 512..519 and its
# "<image>" IMAGE_TOKEN_ID; the Processor's image_seq_len is in processor_config.json, as released.
_IDEFICS_TOKENS = ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)], "<video>", "<image>")


def _idefics(processor: str, patch: int, scale: int) -> dict[str, Any]:
    return {"config": {"image_token_id": IMAGE_TOKEN_ID, "scale_factor": scale},
            "vision_config": {"num_hidden_layers": 2, "image_size": 64, "patch_size": patch, "initializer_range": 0.2},
            "processor": (f"{processor}ImageProcessorPil", {"size": {"longest_edge": 128},
                                                            "max_image_size": {"longest_edge": 64}}),
            "settings": {"image_seq_len": 16, "processor_class": f"{processor}Processor"},
            "tokens": _IDEFICS_TOKENS}


def _qwen_text(**rope: Any) -> dict[str, Any]:
    """The text config's M-RoPE parameters (head_dim 16: sections of 2 + 3 + 3 frequencies)."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3],
                                **rope}}


TINY_VLMS: dict[str, dict[str, Any]] = {
    "llava": {"config": {"image_token_id": IMAGE_TOKEN_ID}, "vision_config": _TOWER, "processor": _CLIP},
    "vipllava": {"config": {"image_token_id": IMAGE_TOKEN_ID, "vision_feature_layers": [-2, -1]},
                 "vision_config": _TOWER, "processor": _CLIP},
    "video_llava": {"config": {"image_token_id": IMAGE_TOKEN_ID, "video_token_id": IMAGE_TOKEN_ID + 1},
                    "vision_config": _TOWER, "processor": ("VideoLlavaImageProcessor", _CLIP[1])},
    # InternVL and Aya Vision tile an image (up to 4 tiles and a thumbnail here; the Processors pass
    # crop_to_patches=True whatever the image processor says); the image token is a tokenizer token at IMAGE_TOKEN_ID.
    "internvl": {"config": {"image_token_id": IMAGE_TOKEN_ID},
                 "vision_config": {"num_hidden_layers": 2, "image_size": [SIDE, SIDE], "patch_size": [14, 14]},
                 "processor": ("GotOcr2ImageProcessor", {**_SQUARE, "crop_to_patches": True, "max_patches": 4}),
                 "settings": {"image_seq_length": 4},
                 "tokens": ("<img>", "</img>", *_FILLER[:6], "<IMG_CONTEXT>")},
    "aya_vision": {"config": {"image_token_id": IMAGE_TOKEN_ID}, "vision_config": _TOWER,
                   "processor": ("GotOcr2ImageProcessor", {**_SQUARE, "crop_to_patches": True, "max_patches": 4}),
                   "settings": {"img_size": SIDE, "patch_size": 14, "downsample_factor": 2,
                                          "tile_token": "<|IMG_TILE|>", "tile_global_token": "<|IMG_TILE_GLOBAL|>"},
                   "tokens": ("<|START_OF_IMG|>", "<|IMG_TILE_GLOBAL|>", "<|END_OF_IMG|>", "<|IMG_TILE|>",
                              *_FILLER[:4], "<|IMG_PATCH|>")},
    "got_ocr2": {"config": {"image_token_id": IMAGE_TOKEN_ID},
                 "vision_config": {"num_hidden_layers": 2, "image_size": 128, "patch_size": 16, "hidden_size": 32,
                                   "mlp_dim": 64, "output_channels": 16, "num_attention_heads": 2, "window_size": 4,
                                   "global_attn_indexes": [1]},
                 "processor": ("GotOcr2ImageProcessor", {"size": {"height": 128, "width": 128},
                                                         "crop_to_patches": False}),
                 "tokens": ("<img>", "</img>")},
    "deepseek_vl": {"config": {"image_token_id": IMAGE_TOKEN_ID}, "vision_config": _TOWER,
                    "processor": ("DeepseekVLImageProcessor", {**_SQUARE, "min_size": 14})},
    "janus": {"config": {"image_token_id": IMAGE_TOKEN_ID},
              "vision_config": {"num_hidden_layers": 2, "image_size": 64, "patch_size": 16, "projection_dim": 64},
              "processor": ("JanusImageProcessor", {"size": {"height": 64, "width": 64}, "min_size": 14}),
              "tokens": ("<begin_of_image>", "<end_of_image>")},
    # Gemma 3: 16 soft tokens an image (4x4 patches, pooled 1:1) seen both ways, a sliding window (8) shorter than
    # an image's block; its boi / eoi tokens at TEXT_VOCAB, TEXT_VOCAB + 1 and the soft token at IMAGE_TOKEN_ID.
    "gemma3": {"config": {"image_token_id": IMAGE_TOKEN_ID, "boi_token_id": TEXT_VOCAB, "eoi_token_id": TEXT_VOCAB + 1,
                          "mm_tokens_per_image": 16},
               # Gemma 3 initialises its projector's weight to zeros (every image's features would be 0) and its norms'
               # (1 + weight) to ones: its post-block norms drawn wider, its blocks outweigh the echoed input token.
               "normal": {"mm_input_projection_weight": 0.2, "post_attention_layernorm.weight": 2.0,
                          "post_feedforward_layernorm.weight": 2.0},
               "text_config": {"sliding_window": 8}, "vision_config": _TOWER,
               "processor": ("Gemma3ImageProcessor", _SQUARE),
               "tokens": ("<start_of_image>", "<end_of_image>", *[f"<unused{i}>" for i in range(6)],
                          "<image_soft_token>")},
    # Qwen2-VL / 2.5-VL / 3-VL: towers that take each image at its own size (pixel_values [patches, C*T*P*P] with
    # grid_thw; exporter/vision_patches.py). Text hidden 64, head_dim 16: mrope_section sums to 8.
    "qwen2_vl": {"config": _QWEN_IDS, "text_config": _qwen_text(), "processor": _QWEN_PROCESSOR,
                 "vision_config": {**_QWEN_INIT, "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                                   "mlp_ratio": 2},
                 "tokens": _QWEN_TOKENS},
    # Block 1 attends over the whole image, blocks 0 and 2 within windows of 2x2 merged tokens (56 pixels).
    "qwen2_5_vl": {"config": _QWEN_IDS, "text_config": _qwen_text(), "processor": _QWEN_PROCESSOR,
                   "vision_config": {**_QWEN_TOWER, "window_size": 56, "fullatt_block_indexes": [1]},
                   "tokens": _QWEN_TOKENS},
    # DeepStack features after blocks 0 and 1; an 8x8 learned position grid, resampled to each image's grid.
    "qwen3_vl": {"config": _QWEN_IDS, "text_config": _qwen_text(mrope_interleaved=True),
                 "vision_config": {**_QWEN_TOWER, "patch_size": 16, "num_position_embeddings": 64,
                                   "deepstack_visual_indexes": [0, 1]},
                 "processor": ("Qwen2VLImageProcessor", {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 36,
                                                         "patch_size": 16, "image_mean": [0.5] * 3,
                                                         "image_std": [0.5] * 3}),
                 "tokens": _QWEN_TOKENS},
    # LLaVA-NeXT / OneVision ("anyres"): 56-pixel tiles of 4x4 patches, the released grids' shapes at 1/6 size, so
    # images of 60..200 pixels take different grids. "<image>" at IMAGE_TOKEN_ID ("<video>" after it); "settings":
    # the Processor's own (processor_config.json), as the released checkpoints save them.
    "llava_next": {"config": {"image_token_id": IMAGE_TOKEN_ID, "image_grid_pinpoints": _NEXT_PINPOINTS},
                   "vision_config": _TOWER,
                   "processor": ("LlavaNextImageProcessor", {**_CLIP[1], "image_grid_pinpoints": _NEXT_PINPOINTS}),
                   "settings": {"patch_size": 14, "vision_feature_select_strategy": "default",
                                "num_additional_image_tokens": 1},
                   "tokens": _LLAVA_TOKENS},
    # anyres_max_4 of 16-token tiles: grids of more than 4 tiles' features (2x3, 3x3) are pooled down.
    "llava_onevision": {"config": {"image_token_id": IMAGE_TOKEN_ID, "video_token_id": IMAGE_TOKEN_ID + 1,
                                   "image_grid_pinpoints": _ONEVISION_PINPOINTS, "vision_aspect_ratio": "anyres_max_4"},
                        "vision_config": _TOWER,
                        "processor": ("LlavaOnevisionImageProcessor", {**_SQUARE,
                                                                       "image_grid_pinpoints": _ONEVISION_PINPOINTS}),
                        "settings": {"num_image_tokens": 16, "vision_feature_select_strategy": "full",
                                     "vision_aspect_ratio": "anyres_max_4"},
                        "tokens": _LLAVA_TOKENS},
    "idefics3": _idefics("Idefics3", 8, 2),
    "smolvlm": _idefics("SmolVLM", 4, 4),
}


def tiny_vlm_config(model_type: str) -> Any:
    """The family's config at test sizes (the text model as the coverage sweep's tiny config of its type)."""
    from transformers import AutoConfig

    from kvforge.tools.coverage_fixtures import tiny_multimodal_config

    recipe = TINY_VLMS[model_type]
    values = tiny_multimodal_config(model_type).to_dict()
    values["text_config"] = {**values["text_config"], "vocab_size": VOCAB_SIZE}
    for name in ("vision_config", "text_config"):
        values[name] = {**values[name], **recipe.get(name, {})}
    values.update(recipe["config"])
    values.pop("model_type", None)
    return AutoConfig.for_model(model_type, **values)


def build_tiny_vlm(model_type: str, folder: Path, seed: int = 0) -> Any:
    """Write the family's tiny seeded checkpoint, its preprocessor_config.json and the built-in tokenizer to
    `folder`; the model (eager attention, eval mode)."""
    import torch
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    folder = Path(folder)
    config = tiny_vlm_config(model_type)
    torch.manual_seed(seed)
    cls = getattr(transformers, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type])
    model = cls._from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # every layer matters for the logits
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(2.0)
            for suffix, std in TINY_VLMS[model_type].get("normal", {}).items():  # weights initialised to zeros
                if name.endswith(suffix):
                    param.normal_(0.0, std)
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_processor(model_type, folder)
    tokenizer = build_tokenizer(TEXT_VOCAB)
    tokenizer.add_special_tokens(list(TINY_VLMS[model_type].get("tokens", ())))  # ids from TEXT_VOCAB on
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token=None).save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     do_sample=False).save_pretrained(folder)
    return model


def save_tiny_processor(model_type: str, folder: Path) -> None:
    """The family's image processor at test sizes, as preprocessor_config.json in `folder`."""
    import warnings

    import transformers

    processor_class, fields = TINY_VLMS[model_type]["processor"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(transformers, processor_class)(**fields).save_pretrained(folder)
    settings = TINY_VLMS[model_type].get("settings")
    if settings:  # the Processor's own settings (its image text), beside its image processor's (4.x's layout)
        (Path(folder) / "processor_config.json").write_text(json.dumps(settings, indent=2) + "\n")
