"""RWKV (v4): its state is five [B, hidden, layers] tensors passed through its forward (feed-forward shift,
attention shift, then the WKV numerator, denominator and running maximum); per layer, kvforge keeps them as
conv0/conv1 (the last token's input to the two time shifts) and recurrent0..2, the maximum starting at HF's -1e30.
The WKV loop becomes a scan."""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvforge.models.families.family import Family
from kvforge.models.families.state_binding import LazyState, StateBinding, StateShapes, fresh
from kvforge.models.families.surgery import backbone

_RWKV_KINDS = ("conv0", "conv1", "recurrent0", "recurrent1", "recurrent2")
_RWKV_FRESH = (0.0, 0.0, 0.0, 0.0, -1e30)

def scan_rwkv_linear_attention(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, state: list[torch.Tensor] | None = None,
                               return_state: bool = False) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """HF's rwkv_linear_attention_cpu (key, value [B, S, A]; state: numerator, denominator, maximum [B, A]) as
    one scan over the positions, in fp32 with the same max-shifted exponentials."""
    from torch._higher_order_ops.scan import scan

    batch, seq, width = key.shape
    if state is None:
        zero = key.new_zeros(batch, width, dtype=torch.float32)
        state = [zero, zero, zero - 1e38]
    decay = (-torch.exp(time_decay.float()))[None, None].expand(seq, batch, width)
    first = time_first.float()[None, None].expand(seq, batch, width)

    def step(carry: list[torch.Tensor], xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        num, den, top = carry
        k, v, w, u = xs
        out_top = torch.maximum(top, k + u)
        e1, e2 = torch.exp(top - out_top), torch.exp(k + u - out_top)
        out = (e1 * num + e2 * v) / (e1 * den + e2)
        new_top = torch.maximum(top + w, k)
        e1, e2 = torch.exp(top + w - new_top), torch.exp(k - new_top)
        return [e1 * num + e2 * v, e1 * den + e2, new_top], out

    final, out = scan(step, [s.float().contiguous() for s in state],
                      [key.float().transpose(0, 1), value.float().transpose(0, 1), decay, first])
    out = out.transpose(0, 1).to(key.dtype)
    return out, (list(final) if return_state or state is not None else None)


class _States:
    def probe(self, model: Any) -> StateShapes:
        with torch.no_grad():
            state = backbone(model)(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True).state
        return {layer: {kind: ((tensor.shape[1],), tensor.dtype) for kind, tensor in zip(_RWKV_KINDS, state, strict=True)}
                for layer in range(state[0].shape[-1])}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> StateBinding:
        layers = model.config.num_hidden_layers
        # HF writes each layer's slice of these stacks in place: fresh tensors, never the graph's inputs.
        stacks = [torch.stack([fresh(past[(layer, kind)], past_lens, fill) for layer in range(layers)], dim=-1)
                  for kind, fill in zip(_RWKV_KINDS, _RWKV_FRESH, strict=True)]
        binding = StateBinding()
        binding.kwargs = {"state": stacks}
        module = sys.modules[type(model).__module__]
        binding.patch(module, "rwkv_linear_attention_cpu", scan_rwkv_linear_attention)
        for index, kind in enumerate(_RWKV_KINDS):
            for layer in range(layers):
                binding.present[(layer, kind)] = LazyState(stacks, index, layer)
        return binding


FAMILIES = (Family("rwkv", (), "WKV state through its forward, its loop a scan", states=_States()),)
