"""GPT-NeoX-Japanese: attention written into its own modeling code (partial rotary), routed through transformers'
attention interface."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, helpers, interface, route


def _attention(self: Any, hidden_states: Any, attention_mask: Any = None, position_ids: Any = None,
               layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
               position_embeddings: Any = None, **_: Any) -> tuple[Any, None, Any]:
    import torch

    batch, seq, _ = hidden_states.shape
    qkv = self.query_key_value(hidden_states).view(batch, seq, self.num_attention_heads, 3 * self.head_size)
    query, key, value = (qkv[..., i * self.head_size:(i + 1) * self.head_size].permute(0, 2, 1, 3) for i in range(3))
    cos, sin = position_embeddings
    rotary = self.rotary_ndims
    query_rot, key_rot = helpers(self).apply_rotary_pos_emb(query[..., :rotary], key[..., :rotary], cos, sin)
    query = torch.cat((query_rot, query[..., rotary:]), dim=-1)
    key = torch.cat((key_rot, key[..., rotary:]), dim=-1)
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                    scaling=1.0 / self.norm_factor)
    return self.dense(out.reshape(batch, seq, -1)), None, self.dense_bias


def adapt(model: Any, patches: Patches) -> str:
    for layer in model.gpt_neox_japanese.layers:
        patches.set(layer.attention, "config", model.config)
        route(layer.attention, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("gpt_neox_japanese", (), "attention in its own code, routed", patch=adapt),)
