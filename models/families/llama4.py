"""Llama 4 (text): its rotary is computed in complex numbers, which have no ONNX form: the rotary module returns
the same angles as real cos / sin tables and the attention rotates pairs in real arithmetic (equal to HF's complex
product up to rounding, under every attention implementation while patched). Its RoPE layers attend within chunks,
so an export holds at most one chunk of positions."""

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


def _attention(self: Any, hidden_states: Any, position_embeddings: RotaryTables, attention_mask: Any,
                      cache: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """HF's Llama4TextAttention.forward with RoPE on real tables (rotate_pairs) and the NoPE layers' temperature
    tuned by the tables' positions (HF: arange + the cache's length, the same positions for an unpadded row)."""
    import torch

    input_shape = hidden_states.shape[:-1]
    query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    if self.use_rope:
        cos, sin = (table[:, :, None, :] for table in position_embeddings)
        query, key = rotate_pairs(query, cos, sin), rotate_pairs(key, cos, sin)
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        positions = position_embeddings.positions.float()
        scales = torch.log1p(torch.floor((positions + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales[..., None, None].expand(*input_shape, 1, 1)).to(query.dtype)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = interface(self.config, helpers(self).eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def adapt(model: Any, patches: Patches) -> str:
    return real_rotary_attention(model, _attention, patches)


def _capacity(config: Any) -> tuple[int, str] | None:
    """Llama 4's RoPE layers attend within chunks of `attention_chunk_size` positions (token p sees the tokens of its
    own chunk, from p - p % chunk), which kvforge's causal op does not model: up to one chunk the two are the same
    attention, so an export is made for at most one chunk of positions."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(config, "layer_types", None) or []):
        return int(chunk), (f"llama4_text: capacity capped at attention_chunk_size={chunk}: its RoPE layers attend "
                            "within chunks of that many positions, which kvforge's attention op does not model; "
                            "within one chunk the export is exact")
    return None


FAMILIES = (Family("llama4_text", (), "complex rotary as real tables; chunked attention capped at one chunk",
                   capacity=_capacity, patch=adapt),)
