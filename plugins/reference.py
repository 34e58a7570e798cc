"""The fused attention op's semantics, in torch: the reference every lowering is checked against.

Inputs (kvforge.core.contract.ATTENTION_INPUTS of the canonical node, kvforge.core.contract.CANONICAL_OP):
  q [B, S, H*D], k [B, S, Hkv*D], v [B, S, Hkv*D]   (after RoPE / q-k norms)
  past_key, past_value [B, Hkv, C, D]                (the cache, capacity C)
  past_lens [B] int32                                (cached tokens per row before this call)
  sinks [H], optional (ATTENTION_OPTIONAL_INPUTS)    (a per-head logit that joins each softmax)
  alibi_slopes [H] fp32, optional                    (ALiBi: score += slope_h * (key_pos - query_pos))
  block_ids [B, S] int64, optional                   (0: a causal token; k > 0: image block k, seen both ways)
  attention_bias [B or 1, H, S, C], optional         (added to the scores at cache positions 0 .. C-1: T5's bias)
Attributes: kvforge.core.contract.AttentionAttrs (H = num_heads, Hkv = kv_num_heads, scale, softcap, window).
Outputs: out [B, S, H*D], present_key, present_value [B, Hkv, C, D].
New rows are written at positions past_lens[b] + t; token t of row b attends cache positions
0 .. past_lens[b] + t (and, with a sliding window W, only those > past_lens[b] + t - W). With block_ids, a token of
block k > 0 also attends the later new tokens of block k (the window still bounds the earlier positions only).
"""

from __future__ import annotations

import torch

from kvforge.core.contract import (
    ATTENTION_OPTIONAL_INPUTS,
    AttentionAttrs,
    attention_parameters,
    check_attention_parameters,
)


def kv_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_lens: torch.Tensor,
    attrs: AttentionAttrs,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_heads, kv_num_heads = attrs.num_heads, attrs.kv_num_heads
    softcap, sliding_window = attrs.softcap, attrs.sliding_window
    batch, seq, _ = q.shape
    head_dim = past_key.shape[-1]
    capacity = past_key.shape[2]
    q4 = q.reshape(batch, seq, num_heads, head_dim).transpose(1, 2)
    k4 = k.reshape(batch, seq, kv_num_heads, head_dim).transpose(1, 2)
    v4 = v.reshape(batch, seq, kv_num_heads, head_dim).transpose(1, 2)

    positions = past_lens.to(torch.int64)[:, None] + torch.arange(seq, device=q.device)  # [B, S]
    index = positions[:, None, :, None].expand(batch, kv_num_heads, seq, head_dim)
    present_key = past_key.scatter(2, index, k4)
    present_value = past_value.scatter(2, index, v4)

    group = num_heads // kv_num_heads
    keys = present_key.repeat_interleave(group, dim=1).float()
    values = present_value.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(q4.float(), keys.transpose(-1, -2)) * attrs.scale  # [B, H, S, C]
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    cache_pos = torch.arange(capacity, device=q.device)
    if alibi_slopes is not None:
        # Relative to the query (HF adds slope * key_pos; the softmax of a row ignores the shift), so the
        # bias stays small at long positions and matches what the lowerings add.
        distance = (cache_pos[None, None, :] - positions[:, :, None]).float()  # [B, S, C]
        scores = scores + alibi_slopes.float().reshape(1, num_heads, 1, 1) * distance[:, None]
    if attention_bias is not None:
        scores = scores + attention_bias.float()
    allowed = cache_pos[None, None, :] <= positions[:, :, None]  # [B, S, C]
    if block_ids is not None:
        allowed = allowed | same_block(block_ids, past_lens, capacity)
    if sliding_window > 0:
        allowed &= cache_pos[None, None, :] > positions[:, :, None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink is one more column of the softmax, with no value: it only takes probability mass
        sink = sinks.float().reshape(1, num_heads, 1, 1).expand(batch, num_heads, seq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, values).to(q.dtype)
    out = out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)
    return out, present_key, present_value


def same_block(block_ids: torch.Tensor, past_lens: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, S, C]: whether cache position c holds a new token of the same image block (k > 0) as new token t. The
    new tokens are at past_lens[b] + 0..S-1; earlier positions belong to no block of this call."""
    seq = block_ids.shape[1]
    offset = torch.arange(capacity, device=block_ids.device)[None, :] - past_lens.to(torch.int64)[:, None]  # [B, C]
    inside = (offset >= 0) & (offset < seq)
    key_block = torch.gather(block_ids, 1, offset.clamp(0, seq - 1)) * inside  # [B, C]: 0 outside this call
    return (block_ids[:, :, None] == key_block[:, None, :]) & (block_ids[:, :, None] > 0)


check_attention_parameters(kv_cache_attention, attention_parameters(spelled=False) + ATTENTION_OPTIONAL_INPUTS)
