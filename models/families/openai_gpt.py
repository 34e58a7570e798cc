"""OpenAI GPT: attention written into its own modeling code, blocks without a layer index (HF keeps no cache for
it), routed through transformers' attention interface."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, interface, route


def _attention(self: Any, x: Any, attention_mask: Any = None, output_attentions: bool = False, **_: Any) -> list[Any]:
    batch, seq, _ = x.shape
    query, key, value = (self.split_heads(part) for part in self.c_attn(x).split(self.split_size, dim=2))
    scaling = value.size(-1) ** -0.5 if self.scale else 1.0
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=scaling)
    return [self.resid_dropout(self.c_proj(out.reshape(batch, seq, -1)))]


def adapt(model: Any, patches: Patches) -> str:
    for index, block in enumerate(model.transformer.h):
        patches.set(block.attn, "layer_idx", index)
        patches.set(block.attn, "config", model.config)
        route(block.attn, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("openai-gpt", (), "attention in its own code, routed", patch=adapt),)
