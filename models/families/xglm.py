"""XGLM: self-attention written into its own modeling code, routed through transformers' attention interface."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, interface, route


def _attention(self: Any, hidden_states: Any, key_value_states: Any = None, cache: Any = None,
               attention_mask: Any = None, **_: Any) -> tuple[Any, None]:
    # HF scales the query before its product with the keys; the interface scales the scores (the same to rounding).
    batch, seq, _ = hidden_states.shape
    query, key, value = (proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling)
    return self.out_proj(out.reshape(batch, seq, self.embed_dim)), None


def adapt(model: Any, patches: Patches) -> str:
    for layer in model.model.layers:  # self-attention only: a causal LM builds no cross-attention
        patches.set(layer.self_attn, "config", model.config)
        route(layer.self_attn, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("xglm", (), "attention in its own code, routed", patch=adapt),)
