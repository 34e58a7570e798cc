"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: their text models rotate by multimodal positions (M-RoPE).

Each token carries three positions (temporal, height, width): equal for text, the image grid's rows and columns for
an image's tokens, which therefore take fewer positions than they are tokens. So a whole-model export's prefill takes
the positions (contract.POSITION_IDS, computed by the runtime as transformers' `get_rope_index`) and its decode a
per-row offset from `past_lens` (contract.ROPE_DELTAS). The text model alone (`--text-only`, or a prompt without
images) has the three equal to `past_lens + t`.

transformers ships these text models without a causal-LM class (the whole model's class holds the head), so this
module makes one: the text model under `model.` and `lm_head`, as the checkpoints' language-model tensors are named
once the loader strips their prefix (exporter/text_model.py).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from kvforge.models.families.family import Family

# text model_type -> (transformers' modeling module, its text model class, its pretrained base class)
_TEXT_MODELS = {
    "qwen2_vl_text": ("qwen2_vl", "Qwen2VLTextModel", "Qwen2VLPreTrainedModel"),
    "qwen2_5_vl_text": ("qwen2_5_vl", "Qwen2_5_VLTextModel", "Qwen2_5_VLPreTrainedModel"),
    "qwen3_vl_text": ("qwen3_vl", "Qwen3VLTextModel", "Qwen3VLPreTrainedModel"),
}


def text_class(config: Any) -> type:
    """The causal-LM class of a Qwen-VL text config (made once per type)."""
    return _causal_lm(config.model_type)


@functools.cache
def _causal_lm(text_type: str) -> type:
    import torch
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    package, model_name, base_name = _TEXT_MODELS[text_type]
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    text_model, base = getattr(module, model_name), getattr(module, base_name)

    class TextForCausalLM(base, GenerationMixin):
        config_class = text_model.config_class
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = text_model(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_input_embeddings(self) -> Any:
            return self.model.embed_tokens

        def get_output_embeddings(self) -> Any:
            return self.lm_head

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            kwargs.pop("logits_to_keep", None)
            out = self.model(input_ids=input_ids, **kwargs)
            return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                          past_key_values=out.past_key_values)

    TextForCausalLM.__name__ = TextForCausalLM.__qualname__ = f"{model_name.removesuffix('Model')}ForCausalLM"
    return TextForCausalLM


def _add_deepstack(self: Any, hidden_states: Any, visual_pos_masks: Any, visual_embeds: Any) -> Any:
    """HF's Qwen3VLTextModel._deepstack_process (the k-th image token's hidden state plus the k-th row of
    `visual_embeds`) as a gather, which traces with any number of image tokens (HF's boolean-mask assignment does
    not); a token beyond the rows given gains nothing, as merge_image_features leaves it (exporter/wrapper.py)."""
    import torch

    flat = visual_pos_masks.reshape(-1).to(torch.int64)
    rank = torch.cumsum(flat, 0) * flat
    given = (rank > 0) & (rank <= visual_embeds.shape[0])
    table = torch.cat([visual_embeds.new_zeros(1, visual_embeds.shape[-1]), visual_embeds], 0).to(hidden_states.dtype)
    return hidden_states + table[torch.where(given, rank, torch.zeros_like(rank))].reshape(hidden_states.shape)


DEEPSTACK = "DeepStack image features added after the first layers by a gather (traceable)"


def mrope_record(config: Any) -> dict[str, Any]:
    """What the runtime needs of a whole Qwen-VL config to make its positions and its tower's inputs without torch
    (runtime/media/mrope.py): the token ids, the tower's sizes, and how videos take positions (Qwen2.5-VL's
    temporal scale, tokens_per_second; Qwen3-VL's one run per frame group)."""
    vision = config.vision_config
    return {"image_token_id": config.image_token_id, "video_token_id": config.video_token_id,
            "spatial_merge_size": vision.spatial_merge_size, "patch_size": vision.patch_size,
            "window_size": getattr(vision, "window_size", None),
            "num_position_embeddings": getattr(vision, "num_position_embeddings", None),
            "video_time_scale": vision.tokens_per_second if config.model_type == "qwen2_5_vl" else None,
            "frame_runs": config.model_type.startswith("qwen3")}


# The types whose videos the runtime takes (Qwen3-VL's processor writes a timestamp text between frame groups, which
# the runtime does not write yet: docs/vision.md).
VIDEO_TYPES = ("qwen2_vl", "qwen2_5_vl")


def deepstack_layers(config: Any) -> int:
    """How many text layers gain an image token's DeepStack features (Qwen3-VL's; 0 for the others)."""
    return len(getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None) or ())


def _adapt_qwen3(model: Any, patches: Any) -> str:
    import types

    patches.set(model.model, "_deepstack_process", types.MethodType(_add_deepstack, model.model))
    return DEEPSTACK


_NOTES = "M-RoPE (three position streams); the text model as a causal LM made by kvforge"
FAMILIES = (
    Family("qwen2_vl", ("Qwen2VLForConditionalGeneration",), _NOTES, text_class=text_class, mrope=True),
    Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), _NOTES, text_class=text_class, mrope=True),
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration",), _NOTES + "; interleaved M-RoPE, DeepStack",
           text_class=text_class, mrope=True, patch=_adapt_qwen3, patch_keeps_weights=True),
)
