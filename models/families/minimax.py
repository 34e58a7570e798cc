"""MiniMax: lightning attention layers keep their K^T V matrix in MiniMax's own cache; the per-token recurrence
becomes a scan and the matrix a state buffer."""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvforge.models.families.family import Family
from kvforge.models.families.state_binding import StateBinding, StateShapes, fresh
from kvforge.models.families.surgery import cache_keyword, pass_through_layer


def scan_lightning_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slope_rate: torch.Tensor,
                             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax's lightning attention over [B, H, S, D] inputs from `state` [B, H, D, D] (K^T V, zeros where
    None) as HF's per-token form computes it: per position the state decays by exp(-slope_rate) and takes
    k^T v, and the output is q state. (HF's blockwise form for a fresh prompt is the same sum, regrouped.)
    Returns the output [B, H, S, D] and the final state."""
    from torch._higher_order_ops.scan import scan

    batch, heads, seq, dim = key.shape
    if state is None:
        state = value.new_zeros(batch, heads, dim, value.shape[-1])
    ratio = torch.exp(-slope_rate).to(value.dtype)[None, None].expand(seq, batch, heads, 1, 1)

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, decay = xs  # [B, H, D] x 3, [B, H, 1, 1]
        state = decay * state + k[..., :, None] * v[..., None, :]
        return state, (q[..., :, None] * state).sum(dim=-2)

    final, out = scan(step, state.contiguous(), [t.permute(2, 0, 1, 3) for t in (query, key, value)] + [ratio])
    return out.permute(1, 2, 0, 3), final


def _lightning_forward(self: Any, hidden_states: torch.Tensor, position_embeddings: Any = None,
                       attention_mask: torch.Tensor | None = None, cache: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMaxLightningAttention.forward with the sequence loop as a scan (same projections, norm and gate)."""
    module = sys.modules[type(self).__module__]
    batch, seq, _ = hidden_states.shape
    qkv = module.apply_mask_to_padding_states(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)
    qkv = qkv.reshape(batch, seq, self.num_attention_heads, 3 * self.head_dim)
    query, key, value = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
    state = cache.get_linear_cache(self.layer_idx) if cache is not None else None
    # Detached: scan's autograd form fails torch.onnx's decomposition when only some inputs need grad (the
    # decay is a buffer); an export never trains.
    out, state = scan_lightning_attention(query.detach(), key.detach(), value.detach(), self.slope_rate, state)
    out = out.transpose(1, 2).reshape(batch, seq, self.num_attention_heads * self.head_dim)
    out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * self.norm(out))
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, state)
    return out, state


class _States:
    def _linear_layers(self, model: Any) -> list[int]:
        return [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]

    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(model.parameters()).dtype
        return {layer: {"recurrent0": ((config.num_attention_heads, dim, dim), dtype)}
                for layer in self._linear_layers(model)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> StateBinding:
        from transformers.cache_utils import Cache

        module = sys.modules[type(model).__module__]
        binding = StateBinding()
        reads = {layer: fresh(past[(layer, "recurrent0")], past_lens) for layer in self._linear_layers(model)}

        class TraceCache(module.MiniMaxCache):  # MiniMax's forward takes no other cache class
            def __init__(self) -> None:
                Cache.__init__(self, layers=[pass_through_layer()() for _ in range(model.config.num_hidden_layers)])
                self.linear_cache = []

            def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
                return reads.get(layer_idx)

            def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
                binding.present[(layer_idx, "recurrent0")] = linear_cache

        binding.kwargs = {cache_keyword(model): TraceCache()}
        binding.patch(module.MiniMaxLightningAttention, "forward", _lightning_forward)
        return binding


FAMILIES = (Family("minimax", (), "lightning attention's K^T V state, its recurrence a scan", states=_States()),)
