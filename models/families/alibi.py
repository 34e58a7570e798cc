"""BLOOM and MPT: their position information is ALiBi alone (each head adds slope_h * key position to its
scores). Their attention is routed through transformers' interface with the module's per-head slopes (fp32) in
`module.alibi_slopes`, which kvforge's op takes as its `alibi_slopes` input (exporter/wrapper.py). The slopes are
read back from HF's own alibi builders, so whatever they do for head counts that are not a power of two (BLOOM
interleaves a second geometric series, MPT reorders a longer one) is what the export does."""

from __future__ import annotations

import functools
from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import ROUTED, Patches, helpers, interface, route, routed


def _bloom_attention(self: Any, hidden_states: Any, residual: Any, alibi: Any = None, attention_mask: Any = None,
                     layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
                     **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                    scaling=self.inv_norm_factor)
    out = self.dense(out.reshape(batch, seq, -1))
    return helpers(self).dropout_add(out, residual, self.hidden_dropout, self.training), None


def adapt_bloom(model: Any, patches: Patches) -> str:
    import torch

    base = model.transformer
    heads = model.config.n_head
    # build_alibi_tensor(mask, H, dtype)[h, 0, j] = slope_h * j over the unpadded positions j: j = 1 is the slope.
    slopes = base.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]
    for block in base.h:
        attention = block.self_attention
        patches.set(attention, "config", model.config)
        # A plain attribute: a dtype cast of the model leaves it fp32.
        patches.set(attention, "alibi_slopes", slopes.clone())
        route(attention, _bloom_attention, model.config, patches)
    return ROUTED + ", with ALiBi slopes"


def _mpt_attention(self: Any, hidden_states: Any, position_bias: Any = None, cache: Any = None,
                   attention_mask: Any = None, **_: Any) -> tuple[Any, None]:
    batch, seq = hidden_states.shape[:2]
    fused = self.Wqkv(hidden_states)
    if self.clip_qkv:
        fused = fused.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (part.reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                         for part in fused.chunk(3, dim=2))
    out, _ = interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=self.softmax_scale)
    return self.out_proj(out.reshape(batch, seq, -1)), None


def _mpt_mask(patches: Patches) -> None:
    """HF's MptModel casts create_causal_mask's result to bool, but under an attention implementation transformers
    has no mask function for (kvforge's op, its probe) that result is None and the cast fails. While the export's
    patches hold, routed attention gets a placeholder instead: it is causal by itself and reads no mask."""
    import torch
    from transformers.models.mpt import modeling_mpt

    original = modeling_mpt.create_causal_mask

    @functools.wraps(original)
    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        mask = original(*args, **kwargs)
        config = kwargs.get("config", args[0] if args else None)
        if mask is None and config is not None and routed(config):
            return torch.zeros((), dtype=torch.bool)
        return mask

    patches.set(modeling_mpt, "create_causal_mask", create_causal_mask)


def adapt_mpt(model: Any, patches: Patches) -> str:
    _mpt_mask(patches)
    base = model.transformer
    heads = model.config.n_heads
    # HF's MptModel builds its bias as build_mpt_alibi_tensor(H, max_seq_len) with the default alibi_bias_max (8),
    # whatever attn_config says; [h, 0, j] = slope_h * (j - L + 1), so with L = 2, column 0 is -slope_h.
    slopes = -base.build_mpt_alibi_tensor(heads, 2)[:, 0, 0].float()
    for block in base.blocks:
        attention = block.attn
        patches.set(attention, "config", model.config)
        patches.set(attention, "alibi_slopes", slopes.clone())
        route(attention, _mpt_attention, model.config, patches)
    return ROUTED + ", with ALiBi slopes"


def _mpt_capacity(config: Any) -> tuple[int, str] | None:
    # HF's bias has max_seq_len columns: a longer context fails there, so nothing beyond it is checked.
    return int(config.max_seq_len), (f"mpt: capacity capped at max_seq_len={config.max_seq_len}: HF's ALiBi bias "
                                     "covers that many positions and no more")


FAMILIES = (
    Family("bloom", (), "ALiBi, attention in its own code, routed", patch=adapt_bloom),
    Family("mpt", (), "ALiBi, attention in its own code, routed; capacity max_seq_len", capacity=_mpt_capacity,
           patch=adapt_mpt),
)
