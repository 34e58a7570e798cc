"""Export adapters: small per-family changes that put a loaded HF model's attention where kvforge reaches it.

kvforge's export routes attention through transformers' attention interface (`config._attn_implementation`
set to kvforge's op while tracing; exporter/wrapper.py). Some families never call that interface: their
attention is written into their own modeling code (Falcon, GPT-Neo, XGLM, OpenAI GPT, GPT-NeoX-Japanese, GIT),
or their rotary embedding is computed in complex numbers, which has no ONNX form (Llama 4, DeepSeek-V2), or an
indexer picks which cached positions attention reads (DeepSeek sparse attention: below, its own note). For
each of the first two, an adapter replaces the attention module's `forward` on the loaded model with one that computes q/k/v
with the module's own projections and HF's own rotary helper, then makes the canonical call

    ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask,
                                                         dropout=0.0, scaling=..., [sliding_window=...])

with `module.layer_idx` set, and nothing more. Under transformers' own implementations (eager, sdpa, ...) the
replaced forwards call HF's original code, so an adapted model still is HF's model (the complex-rotary
families excepted: their rotary is real-valued throughout, equal to the complex product up to rounding).

GPT-J and CodeGen need no adapter with the transformers kvforge is tested with (5.24): their attention
calls the interface already.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.gemma3n import adapt_gemma3n

# What the adapters say they did (adapt_for_export's progress line).
ROUTED = "attention routed through transformers' attention interface"
REAL_ROTARY = "rotary embedding computed from real cos/sin tables instead of complex numbers (no ONNX form)"
# transformers' own attention implementations: an adapted module runs HF's original code under these.
_HF_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention", "flex_attention", "paged")


def _routed(config: Any) -> bool:
    """Whether attention goes through the interface's function (kvforge's op, its probe) rather than HF's code."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return not implementation.startswith(_HF_IMPLEMENTATIONS)


def _interface(config: Any, default: Callable | None = None) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = config._attn_implementation
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default) if default is not None \
        else ALL_ATTENTION_FUNCTIONS[implementation]


def _helpers(module: Any) -> types.ModuleType:
    """The modeling file that defines the module's class: its own rotary helpers."""
    return sys.modules[type(module).__module__]


def _route(module: Any, canonical: Callable, config: Any) -> None:
    """module.forward := the canonical call when attention is routed, HF's original forward otherwise."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _routed(config):
            return canonical(module, *args, **kwargs)
        return original(*args, **kwargs)

    module.forward = forward


# -- complex rotary as its real-valued equivalent ---------------------------------------------------------------


def rotate_pairs(x: Any, cos: Any, sin: Any) -> Any:
    """x rotated as `view_as_real(view_as_complex(x.reshape(..., -1, 2)) * (cos + i sin)).flatten(-2)`: adjacent
    pairs (x[2i], x[2i+1]) times the unit complex number of angle i, in real arithmetic (computed in fp32 as HF
    does, returned in x's dtype). `cos` / `sin` broadcast against x's shape with its last dim halved."""
    import torch

    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RotaryTables(tuple):
    """(cos, sin) [B, S, D/2] of a complex-rotary family's angles (scaled like HF's freqs_cis), with the
    positions they were made for (Llama 4's NoPE layers scale their queries by position)."""

    positions: Any

    def __new__(cls, cos: Any, sin: Any, positions: Any) -> RotaryTables:
        tables = super().__new__(cls, (cos, sin))
        tables.positions = positions
        return tables


def _real_rotary(rotary: Any) -> None:
    """A complex-rotary module (Llama 4's, DeepSeek-V2's: `torch.polar(1, position * inv_freq) * scaling`) made to
    return the same angles as real cos / sin tables (RotaryTables), under every attention implementation."""
    import torch
    from transformers.modeling_rope_utils import dynamic_rope_update

    @dynamic_rope_update  # as HF's forward: dynamic / LongRoPE frequency updates before the tables
    def forward(self: Any, x: Any, position_ids: Any) -> RotaryTables:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return RotaryTables(freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling, position_ids)

    rotary.forward = types.MethodType(forward, rotary)


# -- Falcon ------------------------------------------------------------------------------------------------------


def _falcon_attention(self: Any, hidden_states: Any, alibi: Any = None, attention_mask: Any = None,
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
    query, key = _helpers(self).apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                     scaling=self.inv_norm_factor)
    return self.dense(out.reshape(batch, seq, -1)), None


def adapt_falcon(model: Any) -> str:
    if model.config.alibi:
        raise UnsupportedModelError("falcon: alibi=True: ALiBi position biases (no rotary or learned positions), "
                                    "which kvforge's attention op does not model yet")
    for block in model.transformer.h:
        _route(block.self_attention, _falcon_attention, model.config)
    return ROUTED


# -- GPT-Neo ---------------------------------------------------------------------------------------------------


def _gpt_neo_attention(self: Any, hidden_states: Any, attention_mask: Any = None, layer_past: Any = None,
                       use_cache: bool = False, output_attentions: bool = False, **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = (self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    # GPT-Neo does not scale its scores; its local layers see the last `window_size` positions (self included).
    window = self.config.window_size if self.attention_type == "local" else None
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=1.0,
                                     sliding_window=window)
    return self.resid_dropout(self.out_proj(out.reshape(batch, seq, -1))), None


def adapt_gpt_neo(model: Any) -> str:
    for block in model.transformer.h:
        attention = block.attn.attention
        attention.layer_idx = attention.layer_id
        _route(attention, _gpt_neo_attention, model.config)
    return ROUTED


# -- XGLM ------------------------------------------------------------------------------------------------------


def _xglm_attention(self: Any, hidden_states: Any, key_value_states: Any = None, cache: Any = None,
                    attention_mask: Any = None, **_: Any) -> tuple[Any, None]:
    # HF scales the query before its product with the keys; the interface scales the scores (the same to rounding).
    batch, seq, _ = hidden_states.shape
    query, key, value = (proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling)
    return self.out_proj(out.reshape(batch, seq, self.embed_dim)), None


def adapt_xglm(model: Any) -> str:
    for layer in model.model.layers:  # self-attention only: a causal LM builds no cross-attention
        layer.self_attn.config = model.config
        _route(layer.self_attn, _xglm_attention, model.config)
    return ROUTED


# -- OpenAI GPT ------------------------------------------------------------------------------------------------


def _openai_gpt_attention(self: Any, x: Any, attention_mask: Any = None, output_attentions: bool = False,
                          **_: Any) -> list[Any]:
    batch, seq, _ = x.shape
    query, key, value = (self.split_heads(part) for part in self.c_attn(x).split(self.split_size, dim=2))
    scaling = value.size(-1) ** -0.5 if self.scale else 1.0
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=scaling)
    return [self.resid_dropout(self.c_proj(out.reshape(batch, seq, -1)))]


def adapt_openai_gpt(model: Any) -> str:
    for index, block in enumerate(model.transformer.h):
        block.attn.layer_idx = index  # its blocks have no index: HF keeps no cache for this family
        block.attn.config = model.config
        _route(block.attn, _openai_gpt_attention, model.config)
    return ROUTED


# -- GPT-NeoX-Japanese -----------------------------------------------------------------------------------------


def _gpt_neox_japanese_attention(self: Any, hidden_states: Any, attention_mask: Any = None, position_ids: Any = None,
                                 layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
                                 position_embeddings: Any = None, **_: Any) -> tuple[Any, None, Any]:
    import torch

    batch, seq, _ = hidden_states.shape
    qkv = self.query_key_value(hidden_states).view(batch, seq, self.num_attention_heads, 3 * self.head_size)
    query, key, value = (qkv[..., i * self.head_size:(i + 1) * self.head_size].permute(0, 2, 1, 3) for i in range(3))
    cos, sin = position_embeddings
    rotary = self.rotary_ndims
    query_rot, key_rot = _helpers(self).apply_rotary_pos_emb(query[..., :rotary], key[..., :rotary], cos, sin)
    query = torch.cat((query_rot, query[..., rotary:]), dim=-1)
    key = torch.cat((key_rot, key[..., rotary:]), dim=-1)
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                     scaling=1.0 / self.norm_factor)
    return self.dense(out.reshape(batch, seq, -1)), None, self.dense_bias


def adapt_gpt_neox_japanese(model: Any) -> str:
    for layer in model.gpt_neox_japanese.layers:
        layer.attention.config = model.config
        _route(layer.attention, _gpt_neox_japanese_attention, model.config)
    return ROUTED


# -- GIT (its text decoder: text-only prompts) -------------------------------------------------------------------


def _git_attention(self: Any, hidden_states: Any, attention_mask: Any = None, cache: Any = None,
                   **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = (proj(hidden_states).view(batch, seq, -1, self.attention_head_size).transpose(1, 2)
                         for proj in (self.query, self.key, self.value))
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                     scaling=self.attention_head_size ** -0.5)
    return out.reshape(batch, seq, self.all_head_size), None


def adapt_git(model: Any) -> str:
    for layer in model.git.encoder.layer:
        layer.attention.self.config = model.config
        _route(layer.attention.self, _git_attention, model.config)
    return ROUTED


# -- Llama 4 (text) ----------------------------------------------------------------------------------------------


def _llama4_attention(self: Any, hidden_states: Any, position_embeddings: RotaryTables, attention_mask: Any,
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
    attention = _interface(self.config, _helpers(self).eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def adapt_llama4_text(model: Any) -> str:
    backbone = model.model
    _real_rotary(backbone.rotary_emb)
    for layer in backbone.layers:
        layer.self_attn.forward = types.MethodType(_llama4_attention, layer.self_attn)
    return REAL_ROTARY


def _llama4_capacity(config: Any) -> tuple[int, str] | None:
    """Llama 4's RoPE layers attend within chunks of `attention_chunk_size` positions (token p sees the tokens of its
    own chunk, from p - p % chunk), which kvforge's causal op does not model: up to one chunk the two are the same
    attention, so an export is made for at most one chunk of positions."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(config, "layer_types", None) or []):
        return int(chunk), (f"llama4_text: capacity capped at attention_chunk_size={chunk}: its RoPE layers attend "
                            "within chunks of that many positions, which kvforge's attention op does not model; "
                            "within one chunk the export is exact")
    return None


# -- DeepSeek-V2 -------------------------------------------------------------------------------------------------


def _deepseek_v2_attention(self: Any, hidden_states: Any, attention_mask: Any = None, cache: Any = None,
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
    attention = _interface(self.config, _helpers(self).eager_attention_forward)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


def adapt_deepseek_v2(model: Any) -> str:
    backbone = model.model
    _real_rotary(backbone.rotary_emb)
    for layer in backbone.layers:
        layer.self_attn.forward = types.MethodType(_deepseek_v2_attention, layer.self_attn)
    return REAL_ROTARY


# -- DeepSeek sparse attention ------------------------------------------------------------------------------------


def _all_positions(indexer: Any, config: Any) -> Any:
    """A sparse-attention indexer (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, dots3; Qwen4-Exp's block indexer) that,
    when attention is routed, picks every cached position: the indexer picks the `index_topk` best per query, which
    is all of them while a row holds at most index_topk, so attention over the whole cache is the same attention
    there (the export's capacity is capped at index_topk: _dsa_capacity). Its picks reach kvforge's op only as the `indices` keyword, which the op
    ignores; an empty tensor keeps HF's "shared" DSA layers (which reuse the previous layer's picks) running.
    Under HF's own implementations it is HF's indexer."""
    import torch

    class AllPositions(torch.nn.Module):
        picks_all = True  # what the probe's refusal of sparse attention looks for

        def __init__(self) -> None:
            super().__init__()
            self.hf = indexer

        def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not _routed(config):
                return self.hf(hidden_states, *args, **kwargs)
            if config.model_type == "qwen4_exp_text":  # its indexer returns the kept positions as a boolean mask
                mask = args[1] if len(args) > 1 else kwargs["attention_mask"]
                return torch.ones_like(mask, dtype=torch.bool)
            return hidden_states.new_zeros((*hidden_states.shape[:2], 0), dtype=torch.int32)

    return AllPositions()


def _dsa_attention(self: Any, hidden_states: Any, position_embeddings: Any = None, attention_mask: Any = None,
                   *args: Any, **kwargs: Any) -> Any:
    """The DSA attention's own forward, given a mask when routed: HF slices the mask for its indexer before
    calling it, and kvforge's op (which masks by past_lens) may be handed none."""
    if attention_mask is None and _routed(self.config):
        batch, seq = hidden_states.shape[:2]
        attention_mask = hidden_states.new_zeros((batch, 1, seq, seq))
    return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)


def adapt_sparse_attention(model: Any) -> str:
    for module in list(model.modules()):
        if getattr(module, "indexer", None) is not None:
            module.indexer = _all_positions(module.indexer, module.config)
            module.forward = types.MethodType(_dsa_attention, module)
    return "DSA indexers pick every cached position (exact up to index_topk positions)"


def _dsa_capacity(config: Any) -> tuple[int, str] | None:
    # Qwen4-Exp's indexer keeps the best indexer_budget / compress_ratio blocks of compress_ratio positions (and the
    # incomplete block at the end): every position while a row holds at most indexer_budget of them.
    name = "indexer_budget" if config.model_type == "qwen4_exp_text" else "index_topk"
    topk = getattr(config, name, None)
    if not topk:
        return None
    return int(topk), (f"{config.model_type}: capacity capped at {name}={topk}: its sparse attention attends to the "
                       f"positions its indexer picks, which are all of them up to {name}; beyond, kvforge's dense "
                       "attention would be another model")


DSA_TYPES = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text", "qwen4_exp_text")


# -- BLOOM and MPT: ALiBi -----------------------------------------------------------------------------------------
# Their position information is ALiBi alone: each head adds slope_h * key position to its scores. The adapters
# route attention through the interface with the module's per-head slopes (fp32) in `module.alibi_slopes`, which
# kvforge's op takes as its `alibi_slopes` input (exporter/wrapper.py). The slopes are read back from HF's own
# alibi builders, so whatever they do for head counts that are not a power of two (BLOOM interleaves a second
# geometric series, MPT reorders a longer one) is what the export does.


def _bloom_attention(self: Any, hidden_states: Any, residual: Any, alibi: Any = None, attention_mask: Any = None,
                     layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
                     **_: Any) -> tuple[Any, None]:
    batch, seq, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0,
                                     scaling=self.inv_norm_factor)
    out = self.dense(out.reshape(batch, seq, -1))
    return _helpers(self).dropout_add(out, residual, self.hidden_dropout, self.training), None


def adapt_bloom(model: Any) -> str:
    import torch

    base = model.transformer
    heads = model.config.n_head
    # build_alibi_tensor(mask, H, dtype)[h, 0, j] = slope_h * j over the unpadded positions j: j = 1 is the slope.
    slopes = base.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]
    for block in base.h:
        attention = block.self_attention
        attention.config = model.config
        attention.alibi_slopes = slopes.clone()  # a plain attribute: a dtype cast of the model leaves it fp32
        _route(attention, _bloom_attention, model.config)
    return ROUTED + ", with ALiBi slopes"


def _mpt_attention(self: Any, hidden_states: Any, position_bias: Any = None, cache: Any = None,
                   attention_mask: Any = None, **_: Any) -> tuple[Any, None]:
    batch, seq = hidden_states.shape[:2]
    fused = self.Wqkv(hidden_states)
    if self.clip_qkv:
        fused = fused.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (part.reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                         for part in fused.chunk(3, dim=2))
    out, _ = _interface(self.config)(self, query, key, value, attention_mask, dropout=0.0, scaling=self.softmax_scale)
    return self.out_proj(out.reshape(batch, seq, -1)), None


def _mpt_mask_for_routed_attention() -> None:
    """HF's MptModel casts create_causal_mask's result to bool, but under an attention implementation transformers
    has no mask function for (kvforge's op, its probe) that result is None and the cast fails. Where attention is
    routed, give it a placeholder instead: the routed attention is causal by itself and reads no mask. Under HF's
    own implementations the function is HF's."""
    import torch
    from transformers.models.mpt import modeling_mpt

    original = modeling_mpt.create_causal_mask
    if getattr(original, "_kvforge_placeholder", False):
        return

    @functools.wraps(original)
    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        mask = original(*args, **kwargs)
        config = kwargs.get("config", args[0] if args else None)
        if mask is None and config is not None and _routed(config):
            return torch.zeros((), dtype=torch.bool)
        return mask

    create_causal_mask._kvforge_placeholder = True
    modeling_mpt.create_causal_mask = create_causal_mask


def adapt_mpt(model: Any) -> str:
    _mpt_mask_for_routed_attention()
    base = model.transformer
    heads = model.config.n_heads
    # HF's MptModel builds its bias as build_mpt_alibi_tensor(H, max_seq_len) with the default alibi_bias_max (8),
    # whatever attn_config says; [h, 0, j] = slope_h * (j - L + 1), so with L = 2, column 0 is -slope_h.
    slopes = -base.build_mpt_alibi_tensor(heads, 2)[:, 0, 0].float()
    for block in base.blocks:
        attention = block.attn
        attention.config = model.config
        attention.alibi_slopes = slopes.clone()
        _route(attention, _mpt_attention, model.config)
    return ROUTED + ", with ALiBi slopes"


def _mpt_capacity(config: Any) -> tuple[int, str] | None:
    # HF's bias has max_seq_len columns: a longer context fails there, so nothing beyond it is checked.
    return int(config.max_seq_len), (f"mpt: capacity capped at max_seq_len={config.max_seq_len}: HF's ALiBi bias "
                                     "covers that many positions and no more")


# -- Zamba / Zamba 2: shared attention blocks ----------------------------------------------------------------------


def adapt_shared_attention(model: Any) -> str:
    """Zamba's and Zamba 2's hybrid layers each call a shared attention block (one module per hybrid layer, its
    weights tied across them), which indexes transformers' cache by the calling layer's number, handed to its
    forward, not by the module's own `layer_idx` (None in Zamba, -1 in Zamba 2). kvforge's op takes the layer from
    `module.layer_idx`: set it to the calling layer's, so each hybrid layer keeps its own keys and values, as in
    HF's cache. HF's forward does not read it."""
    for index, layer in enumerate(model.model.layers):  # ZambaForCausalLM / Zamba2ForCausalLM: `model` is the stack
        block = getattr(layer, "shared_transf", None) or getattr(layer, "shared_transformer", None)
        if block is not None:
            block.self_attn.layer_idx = index
    return "each hybrid layer's shared attention block keeps its own keys and values"


# -- the registry ------------------------------------------------------------------------------------------------

# model_type -> adapter(model) -> what it did, most asked-for first.
ADAPTERS: dict[str, Callable[[Any], str]] = {
    "falcon": adapt_falcon,
    "gpt_neo": adapt_gpt_neo,
    "xglm": adapt_xglm,
    "openai-gpt": adapt_openai_gpt,
    "gpt_neox_japanese": adapt_gpt_neox_japanese,
    "git": adapt_git,
    "llama4_text": adapt_llama4_text,
    "deepseek_v2": adapt_deepseek_v2,
    **dict.fromkeys(DSA_TYPES, adapt_sparse_attention),
    **dict.fromkeys(("zamba", "zamba2"), adapt_shared_attention),
    "bloom": adapt_bloom,
    "mpt": adapt_mpt,
    "gemma3n_text": adapt_gemma3n,
}
# model_type -> (the most positions an export of it can hold exactly, why), where its attention limits them.
CAPACITY_LIMITS: dict[str, Callable[[Any], tuple[int, str] | None]] = {
    "llama4_text": _llama4_capacity, **dict.fromkeys(DSA_TYPES, _dsa_capacity), "mpt": _mpt_capacity}


def adapt_for_export(model: Any, layout: Any = None, say: Callable[[str], None] | None = None) -> Any:
    """Apply the model's export adapter (ADAPTERS, by its config's model_type; nothing for a family without one),
    once. Returns `layout` (a KVLayout, or None) with its max_capacity capped where the family's attention is
    exact only over fewer positions (CAPACITY_LIMITS), saying why through `say`."""
    config = model.config
    model_type = config.model_type
    adapter = ADAPTERS.get(model_type)
    if adapter is not None and not getattr(model, "_kvforge_adapted", False):
        done = adapter(model)
        model._kvforge_adapted = True
        if say is not None:
            say(f"adapted {model_type} for export: {done}")
    limit = CAPACITY_LIMITS.get(model_type, lambda _config: None)(config)
    if layout is not None and limit is not None and limit[0] < layout.max_capacity:
        layout = dataclasses.replace(layout, max_capacity=limit[0])
        if say is not None:
            say(f"note: {limit[1]}")
    return layout
