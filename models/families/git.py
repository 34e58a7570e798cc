"""GIT's text decoder (text-only prompts): attention written into its own modeling code, routed through
transformers' attention interface."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, interface, route


def _attention(self: Any, hidden_states: Any, attention_mask: Any = None, cache: Any = None,
               **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = (proj(hidden_states).view(batch, seq, -1, self.attention_head_size).transpose(1, 2)
                         for proj in (self.query, self.key, self.value))
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                    scaling=self.attention_head_size ** -0.5)
    return out.reshape(batch, seq, self.all_head_size), None


def adapt(model: Any, patches: Patches) -> str:
    for layer in model.git.encoder.layer:
        patches.set(layer.attention.self, "config", model.config)
        route(layer.attention.self, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("git", (), "text decoder, attention in its own code, routed", patch=adapt),)
