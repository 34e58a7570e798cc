"""Falcon: attention written into its own modeling code, routed through transformers' attention interface (its
rotary from HF's own helper); ALiBi Falcons are refused."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, helpers, interface, route


def _attention(self: Any, hidden_states: Any, alibi: Any = None, attention_mask: Any = None,
               position_ids: Any = None, layer_past: Any = None, use_cache: bool = False,
               output_attentions: bool = False, position_embeddings: Any = None, **_: Any) -> tuple[Any, None]:
    fused = self.query_key_value(hidden_states)
    batch, seq, _ = fused.shape
    if self.new_decoder_architecture:
        # [B, S, KV, group + 2, D]: each KV head's group of queries, then its key and value. HF broadcasts the
        # key and value to every query head; the interface takes them once per KV head (the same attention).
        qkv = fused.view(batch, seq, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        query, key, value = self._split_heads(fused)  # multi-head, or one key/value head (multi_query)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    cos, sin = position_embeddings
    query, key = helpers(self).apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                    scaling=self.inv_norm_factor)
    return self.dense(out.reshape(batch, seq, -1)), None


def _refuse(config: Any) -> str | None:
    if getattr(config, "alibi", False):
        return ("falcon: alibi=True: ALiBi position biases (no rotary or learned positions), which kvforge's attention "
                "op does not model yet")
    return None


def adapt(model: Any, patches: Patches) -> str:
    for block in model.transformer.h:
        route(block.self_attention, _attention, model.config, patches)
    return ROUTED


FAMILIES = (Family("falcon", (), "attention in its own code, routed; no ALiBi", refuse=_refuse, patch=adapt),)
