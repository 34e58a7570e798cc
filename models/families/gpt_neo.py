"""GPT-Neo: attention written into its own modeling code (unscaled scores, local layers over a window), routed
through transformers' attention interface."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, interface, route


def _attention(self: Any, hidden_states: Any, attention_mask: Any = None, layer_past: Any = None,
               use_cache: bool = False, output_attentions: bool = False, **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = (self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    # GPT-Neo does not scale its scores; its local layers see the last `window_size` positions (self included).
    window = self.config.window_size if self.attention_type == "local" else None
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=1.0,
                                    sliding_window=window)
    return self.resid_dropout(self.out_proj(out.reshape(batch, seq, -1))), None


def adapt(model: Any, patches: Patches) -> str:
    for block in model.transformer.h:
        attention = block.attn.attention
        patches.set(attention, "layer_idx", attention.layer_id)
        route(attention, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("gpt_neo", (), "attention in its own code, routed; local layers", patch=adapt),)
