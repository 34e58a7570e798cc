"""Adapts a HF causal LM to kvforge's graph IO, with attention routed through the fused op.

HF's modules still compute projections, norms and RoPE; the registered attention function
receives q/k/v after RoPE and hands them to `torch.ops.kvforge.kv_cache_attention` together with
this layer's cache. Positions come from `past_lens` inside the graph, per the KV contract.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from kvforge.core.contract import AttentionAttrs
from kvforge.models.families import Family, family_for
from kvforge.plugins import torch_op  # noqa: F401  (registers torch.ops.kvforge.kv_cache_attention)

ATTN_IMPLEMENTATION = "kvforge"


_TRACING: dict[str, Any] = {}  # "state": the _CacheState of the GraphWrapper call being traced


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack under the LM head: `base_model` (`model` for most families, `transformer` for
    GPT-2), or its `model` where the class's base_model_prefix names no attribute (Llama 4's text LM)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


class _CacheState:
    """Per-call side channel: the layers' past buffers in, their present buffers out."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], past_lens: torch.Tensor) -> None:
        self.past = past
        self.past_lens = past_lens
        self.present: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)


def kvforge_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    # The state of the GraphWrapper call being traced: a module-level slot, not a keyword, since some
    # decoder layers drop keywords they do not know (StableLM, Nemotron).
    state = _TRACING.get("state")
    if state is None:
        raise RuntimeError("kvforge attention called outside an export wrapper")
    batch, num_heads, seq, head_dim = query.shape
    kv_heads = key.shape[1]
    layer = module.layer_idx
    past_key, past_value = state.past[layer]
    attrs = AttentionAttrs(num_heads, kv_heads, float(scaling if scaling is not None else head_dim**-0.5),
                           float(softcap or 0.0), int(sliding_window or 0))
    out, present_key, present_value = torch.ops.kvforge.kv_cache_attention(
        query.transpose(1, 2).reshape(batch, seq, num_heads * head_dim),
        key.transpose(1, 2).reshape(batch, seq, kv_heads * head_dim),
        value.transpose(1, 2).reshape(batch, seq, kv_heads * head_dim),
        past_key,
        past_value,
        state.past_lens,
        # Attention sinks, one logit per query head (gpt-oss, Flint, Granite SWA; the probe refuses other forms).
        None if s_aux is None else s_aux.to(query.dtype),
        *attrs.as_dict().values(),  # the op's attribute parameters, in AttentionAttrs' field order
    )
    state.present[layer] = (present_key, present_value)
    return out.view(batch, seq, num_heads, head_dim), None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvforge_attention)


class GraphWrapper(torch.nn.Module):
    """forward(input_ids, past_lens, [logits_index,] *past) -> (logits, *present)

    `past` is flat: past_key.0, past_value.0, past_key.1, ... ; `present` likewise.
    Prefill returns logits [B, K, V] at positions `logits_index[b, k]` of each row (K = 1 for a
    plain prefill; K > 1 verifies speculative drafts in one call); decode [B, V] at its one position.
    Only the selected positions go through lm_head.
    """

    def __init__(self, model: torch.nn.Module, phase: str, family: Family | None = None) -> None:
        super().__init__()
        if phase not in ("prefill", "decode"):
            raise ValueError(phase)
        self.model = model
        self.phase = phase
        self.family = family if family is not None else family_for(model.config)

    def forward(self, input_ids: torch.Tensor, past_lens: torch.Tensor, *rest: torch.Tensor):
        if self.phase == "prefill":
            logits_index, past_flat = rest[0], rest[1:]
        else:
            logits_index, past_flat = None, rest
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        state = _CacheState(past, past_lens)
        seq = input_ids.shape[1]
        position_ids = past_lens.to(torch.int64)[:, None] + torch.arange(seq, dtype=torch.int64)
        # Route attention through the fused op only for this call, so the same model object can
        # still serve as the HF eager reference (parity) afterwards.
        config = self.model.config
        saved, config._attn_implementation = config._attn_implementation, ATTN_IMPLEMENTATION
        _TRACING["state"] = state
        try:
            hidden = backbone(self.model)(
                input_ids=input_ids, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        finally:
            config._attn_implementation = saved
            _TRACING.pop("state", None)
        if logits_index is None:
            selected = hidden[:, -1, :]
        else:
            gather = logits_index[:, :, None].expand(-1, -1, hidden.shape[-1])
            selected = torch.gather(hidden, 1, gather)  # [B, K, H]
        logits = self.family.finish_logits(config, self.model.get_output_embeddings()(selected)).float()
        present = [tensor for pair in state.present for tensor in pair]
        return (logits, *present)
