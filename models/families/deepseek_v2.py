"""DeepSeek-V2: latent attention whose rotary is computed in complex numbers (no ONNX form): the rotary module
returns real cos / sin tables and the attention rotates pairs in real arithmetic."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import (
    Patches,
    RotaryTables,
    helpers,
    interface,
    real_rotary_attention,
    rotate_pairs,
)


def _attention(self: Any, hidden_states: Any, attention_mask: Any = None, cache: Any = None,
                           position_embeddings: RotaryTables | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """HF's DeepseekV2Attention.forward with its rotary on real tables (rotate_pairs)."""
    import torch

    batch, seq = hidden_states.shape[:-1]
    if self.q_lora_rank is None:
        query = self.q_proj(hidden_states)
    else:
        query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    query = query.view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    query_nope, query_pe = torch.split(query, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, key_pe = torch.split(compressed, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    key_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, self.kv_lora_rank)
    key_pe = key_pe.view(batch, 1, seq, self.qk_rope_head_dim)
    cos, sin = (table[:, None] for table in position_embeddings)  # [B, 1, S, R/2] over BNSH's heads
    query_pe, key_pe = rotate_pairs(query_pe, cos, sin), rotate_pairs(key_pe, cos, sin)
    if cache is not None:
        key_nope, key_pe = cache.update(key_nope, key_pe, self.layer_idx, kwargs=kwargs)
    query = torch.cat((query_nope, query_pe), dim=-1)
    key, value = self.expand_kv(key_nope, key_pe)
    attention = interface(self.config, helpers(self).eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


def adapt(model: Any, patches: Patches) -> str:
    return real_rotary_attention(model, _attention, patches)


FAMILIES = (Family("deepseek_v2", (), "latent attention, complex rotary as real tables", patch=adapt),)
