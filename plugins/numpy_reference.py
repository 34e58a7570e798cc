"""The fused attention op's semantics in numpy: the torch-free twin of plugins/reference.py.

The runtime's CPU emulation of the `trt` target serves the plugin node with it when asked (backend
option emulation="reference"), so that path needs neither torch nor triton. Unlike the torch reference
it writes the new rows into `past_key` / `past_value` in place, as the TensorRT plugin does.
"""

from __future__ import annotations

import numpy as np

from kvforge.core.contract import (
    ATTENTION_OPTIONAL_INPUTS,
    AttentionAttrs,
    attention_parameters,
    check_attention_parameters,
)


def kv_cache_attention_(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    past_key: np.ndarray,
    past_value: np.ndarray,
    past_lens: np.ndarray,
    attrs: AttentionAttrs,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_ids: np.ndarray | None = None,
    attention_bias: np.ndarray | None = None,
) -> np.ndarray:
    """Append k/v at past_lens[b] + t into the caches (in place) and return the attention output
    [B, S, H*D] in q's dtype. Scores and softmax in float64 (an oracle, not a fast path). The optional
    inputs mean what plugins/reference.py says."""
    num_heads, kv_num_heads = attrs.num_heads, attrs.kv_num_heads
    softcap, sliding_window = attrs.softcap, attrs.sliding_window
    batch, seq, _ = q.shape
    capacity, head_dim = past_key.shape[2], past_key.shape[3]
    if int(np.max(past_lens)) + seq > capacity:
        raise ValueError(f"past_lens + S = {int(np.max(past_lens)) + seq} exceeds the cache capacity {capacity}")
    q4 = q.reshape(batch, seq, num_heads, head_dim).transpose(0, 2, 1, 3)
    k4 = k.reshape(batch, seq, kv_num_heads, head_dim).transpose(0, 2, 1, 3)
    v4 = v.reshape(batch, seq, kv_num_heads, head_dim).transpose(0, 2, 1, 3)
    positions = past_lens.astype(np.int64)[:, None] + np.arange(seq)  # [B, S]
    for b in range(batch):
        past_key[b][:, positions[b]] = k4[b]  # past_key[b] is a view: [Hkv, C, D]
        past_value[b][:, positions[b]] = v4[b]
    group = num_heads // kv_num_heads
    keys = np.repeat(past_key, group, axis=1).astype(np.float64)
    values = np.repeat(past_value, group, axis=1).astype(np.float64)
    scores = q4.astype(np.float64) @ keys.transpose(0, 1, 3, 2) * attrs.scale  # [B, H, S, C]
    if softcap > 0.0:
        scores = softcap * np.tanh(scores / softcap)
    cache_pos = np.arange(capacity)
    if alibi_slopes is not None:
        distance = (cache_pos[None, None, :] - positions[:, :, None]).astype(np.float64)  # [B, S, C]
        scores = scores + alibi_slopes.astype(np.float64).reshape(1, num_heads, 1, 1) * distance[:, None]
    if attention_bias is not None:
        scores = scores + attention_bias.astype(np.float64)
    allowed = cache_pos[None, None, :] <= positions[:, :, None]  # [B, S, C]
    if block_ids is not None:
        offset = cache_pos[None, :] - past_lens.astype(np.int64)[:, None]  # [B, C]: the new token at c, if any
        inside = (offset >= 0) & (offset < seq)
        key_block = np.take_along_axis(block_ids, np.clip(offset, 0, seq - 1), axis=1) * inside
        allowed |= (block_ids[:, :, None] == key_block[:, None, :]) & (block_ids[:, :, None] > 0)
    if sliding_window > 0:
        allowed &= cache_pos[None, None, :] > positions[:, :, None] - sliding_window
    scores = np.where(allowed[:, None], scores, -np.inf)
    if sinks is not None:  # one more softmax column per head, with no value
        sink = np.broadcast_to(sinks.astype(np.float64).reshape(1, num_heads, 1, 1), (batch, num_heads, seq, 1))
        scores = np.concatenate([scores, sink], axis=-1)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs[..., :capacity]
    out = (probs @ values).astype(q.dtype)  # [B, H, S, D]
    return out.transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head_dim)


check_attention_parameters(kv_cache_attention_, attention_parameters(spelled=False) + ATTENTION_OPTIONAL_INPUTS)
