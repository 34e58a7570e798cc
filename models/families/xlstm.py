"""xLSTM (mLSTM): the cells keep their matrix C, normalizer n and maximum m in xLSTM's own cache; the per-token
recurrence becomes a scan and the three a layer's state buffers."""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvforge.models.families.family import Family
from kvforge.models.families.state_binding import StateBinding, StateShapes, fresh
from kvforge.models.families.surgery import backbone, cache_keyword

_XLSTM_KINDS = ("recurrent0", "recurrent1", "recurrent2")  # the cell matrix C, the normalizer n, the maximum m

def scan_mlstm(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
               c_initial: torch.Tensor | None = None, n_initial: torch.Tensor | None = None,
               m_initial: torch.Tensor | None = None, eps: float = 1e-6,
               dtype_state: torch.dtype = torch.float32) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """HF's mlstm_recurrent_sequence_native (query, key [B, NH, S, Dqk], value [B, NH, S, Dv], gates [B, NH, S];
    states C [B, NH, Dqk, Dv], n [B, NH, Dqk], m [B, NH, 1], zeros where None) as one scan of its
    mlstm_recurrent_step_native. Returns h [B, NH, S, Dv] and the final (C, n, m)."""
    from torch._higher_order_ops.scan import scan

    batch, heads, _, dim = query.shape
    dtype = query.dtype
    if c_initial is None:
        c_initial = query.new_zeros(batch, heads, dim, value.shape[-1], dtype=dtype_state)
        n_initial = query.new_zeros(batch, heads, dim, dtype=dtype_state)
        m_initial = query.new_zeros(batch, heads, 1, dtype=dtype_state)

    def step(carry: list[torch.Tensor], xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        cell, norm, top = carry
        q, k, v, i, f = xs  # [B, NH, Dqk] x 2, [B, NH, Dv], [B, NH, 1] x 2
        f_log = torch.nn.functional.logsigmoid(f)
        new_top = torch.maximum(f_log + top, i)
        f_act, i_act = torch.exp(f_log + top - new_top), torch.exp(i - new_top)
        q = q * dim**-0.5
        cell = f_act[..., None] * cell + i_act[..., None] * (k[..., :, None] * v[..., None, :])
        norm = f_act * norm + i_act * k
        h_num = (q[..., :, None] * cell.to(dtype)).sum(dim=-2).to(dtype_state)
        qn = (q * norm.to(dtype)).sum(dim=-1, keepdim=True)
        h = h_num / (torch.maximum(qn.abs(), torch.exp(-new_top)) + eps).to(dtype_state)
        return [cell.to(dtype_state), norm.to(dtype_state), new_top.to(dtype_state)], h.to(dtype)

    init = [t.to(dtype_state).contiguous() for t in (c_initial, n_initial, m_initial)]
    final, h = scan(step, init, [query.permute(2, 0, 1, 3), key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3),
                                 igate.permute(2, 0, 1)[..., None], fgate.permute(2, 0, 1)[..., None]])
    return h.permute(1, 2, 0, 3), tuple(final)


def _mlstm_backend_forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
                           fgate: torch.Tensor, c_initial: torch.Tensor | None = None,
                           n_initial: torch.Tensor | None = None, m_initial: torch.Tensor | None = None,
                           **_: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """xLSTMBackend.forward in inference mode, its per-token loop a scan (HF runs chunkwise kernels only from
    chunk_size positions on: the same sums, regrouped). Detached: scan's autograd form fails torch.onnx's
    decomposition; an export never trains."""
    return scan_mlstm(query.detach(), key.detach(), value.detach(), igate.detach(), fgate.detach(), c_initial,
                      n_initial, m_initial, eps=self.config.eps,
                      dtype_state=getattr(torch, self.config.inference_state_dtype))


class _States:
    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dtype = getattr(torch, config.inference_state_dtype)
        # The layers' own widths (config.qk_head_dim rounds the width up to a multiple of 64; the layers do not).
        layer = backbone(model).blocks[0].mlstm_layer
        qk, v = layer.qk_dim // config.num_heads, layer.v_dim // config.num_heads
        shapes = ((config.num_heads, qk, v), (config.num_heads, qk), (config.num_heads, 1))
        return {layer: {kind: (shape, dtype) for kind, shape in zip(_XLSTM_KINDS, shapes, strict=True)}
                for layer in range(config.num_hidden_layers)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> StateBinding:
        from types import SimpleNamespace

        module = sys.modules[type(model).__module__]
        binding = StateBinding()
        # use_cache=False: HF then neither builds its own cache nor counts positions in it, yet still reads and
        # writes (copy_, into these fresh tensors) the rnn_state of the cache it is given.
        binding.use_cache = False
        rnn_state = {layer: tuple(fresh(past[(layer, kind)], past_lens) for kind in _XLSTM_KINDS)
                     for layer in range(model.config.num_hidden_layers)}
        binding.kwargs = {cache_keyword(model): SimpleNamespace(rnn_state=rnn_state)}
        for layer, states in rnn_state.items():
            binding.present.update({(layer, kind): state for kind, state in zip(_XLSTM_KINDS, states, strict=True)})
        binding.patch(module.xLSTMBackend, "forward", _mlstm_backend_forward)
        # HF splits a prompt longer than max_inference_chunksize with a Python loop: a trace would fix the length.
        binding.patch(model.config, "max_inference_chunksize", sys.maxsize)
        return binding


FAMILIES = (Family("xlstm", (), "mLSTM cell states, the recurrence a scan", states=_States()),)
