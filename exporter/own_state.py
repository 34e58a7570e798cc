"""Recurrent layers that keep their state outside transformers' cache, mapped onto kvforge's state buffers.

transformers' linear-attention cache layers (Mamba, gated DeltaNet) hand kvforge their states through a
cache it builds (exporter/wrapper.py's `_state_cache`). Some families keep the state elsewhere: RWKV passes a
`state` list through its forward, MiniMax's lightning attention keeps its K^T V matrix in its own
`MiniMaxCache`, RecurrentGemma's RG-LRU blocks keep theirs in module attributes, xLSTM's mLSTM cells in its
own `xLSTMCache`. Here each such family
says which states a layer keeps (`probe`) and, for one traced call, binds the graph's state inputs to where
the model reads them and collects what it writes as the present states (`bind`). A state input reads as a
fresh state (the model's own initial value) where the row starts at position 0, so no caller resets a buffer.
Sequence loops become `torch._higher_order_ops.scan`, so the prefill graph keeps a dynamic length.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from kvforge.exporter.backbone import backbone, cache_keyword, pass_through_layer

StateShapes = dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]


def _fresh(tensor: torch.Tensor, past_lens: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """`tensor` [B, ...] where the row continues, `value` where it starts at position 0."""
    started = (past_lens > 0).view(-1, *([1] * (tensor.dim() - 1)))
    return torch.where(started, tensor, torch.full_like(tensor, value))


# ----------------------------------------------------------------------------------------------- RWKV (v4)
# HF's state: five [B, hidden, layers] tensors (feed-forward shift, attention shift, then the WKV numerator,
# denominator and running maximum); per layer, kvforge keeps them as conv0/conv1 (the last token's input to
# the two time shifts) and recurrent0..2, the maximum starting at HF's -1e30.
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


class _Binding:
    """One traced call's state binding: the backbone's extra keywords, the patches in force during the call
    (a context manager), and each (layer, kind)'s present state afterwards."""

    use_cache = True

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}
        self.present: dict[tuple[int, str], torch.Tensor] = {}
        self._stack = contextlib.ExitStack()

    def patch(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._stack.callback(setattr, owner, name, original)

    def __enter__(self) -> _Binding:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


class _Rwkv:
    def probe(self, model: Any) -> StateShapes:
        with torch.no_grad():
            state = backbone(model)(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True).state
        return {layer: {kind: ((tensor.shape[1],), tensor.dtype) for kind, tensor in zip(_RWKV_KINDS, state, strict=True)}
                for layer in range(state[0].shape[-1])}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> _Binding:
        layers = model.config.num_hidden_layers
        # HF writes each layer's slice of these stacks in place: fresh tensors, never the graph's inputs.
        stacks = [torch.stack([_fresh(past[(layer, kind)], past_lens, fill) for layer in range(layers)], dim=-1)
                  for kind, fill in zip(_RWKV_KINDS, _RWKV_FRESH, strict=True)]
        binding = _Binding()
        binding.kwargs = {"state": stacks}
        module = sys.modules[type(model).__module__]
        binding.patch(module, "rwkv_linear_attention_cpu", scan_rwkv_linear_attention)
        for index, kind in enumerate(_RWKV_KINDS):
            for layer in range(layers):
                binding.present[(layer, kind)] = _Lazy(stacks, index, layer)
        return binding


class _Lazy:
    """A layer's slice of an RWKV state stack, taken after the forward has written it."""

    def __init__(self, stacks: list[torch.Tensor], index: int, layer: int) -> None:
        self.stacks, self.index, self.layer = stacks, index, layer

    def resolve(self) -> torch.Tensor:
        return self.stacks[self.index][:, :, self.layer]


# ------------------------------------------------------------------------------------ MiniMax lightning attention
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


class _MiniMax:
    def _linear_layers(self, model: Any) -> list[int]:
        return [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]

    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(model.parameters()).dtype
        return {layer: {"recurrent0": ((config.num_attention_heads, dim, dim), dtype)}
                for layer in self._linear_layers(model)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> _Binding:
        from transformers.cache_utils import Cache

        module = sys.modules[type(model).__module__]
        binding = _Binding()
        reads = {layer: _fresh(past[(layer, "recurrent0")], past_lens) for layer in self._linear_layers(model)}

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


# ------------------------------------------------------------------------------------ RecurrentGemma (Griffin)
def scan_linear_recurrence(gate: torch.Tensor, inputs: torch.Tensor,
                           state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = gate_t * h_{t-1} + inputs_t over [B, S, W] (HF's RecurrentGemmaRglru._rnn_scan, gate already zero
    at a reset), accumulated in fp32 from `state` [B, W] (zeros where None): the outputs in the inputs' dtype,
    and the final state in fp32."""
    from torch._higher_order_ops.scan import scan

    if state is None:
        state = inputs.new_zeros(inputs.shape[0], inputs.shape[2], dtype=torch.float32)

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, x = xs
        state = a * state + x
        return state, state.clone()

    final, out = scan(step, state.float().contiguous(),
                      [gate.float().transpose(0, 1), inputs.float().transpose(0, 1)])
    return out.transpose(0, 1).to(inputs.dtype), final


def _rglru(lru: Any, activations: torch.Tensor, position_ids: torch.Tensor,
           state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RecurrentGemmaRglru.forward from an explicit state, its sequence loop a scan; (outputs, final state)."""
    batch, seq, width = activations.shape
    reset = position_ids[:, :, None] == 0
    blocks = activations.reshape(batch * seq, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)

    def gate(bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(batch, seq, width))

    input_gate = gate(lru.input_gate_bias, lru.input_gate_weight)
    log_a = -8.0 * gate(lru.recurrent_gate_bias, lru.recurrent_gate_weight) * torch.nn.functional.softplus(
        lru.recurrent_param)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))  # HF's SqrtBoundDerivative only changes the gradient
    multiplier = reset + ~reset * multiplier
    normalized = activations * input_gate * multiplier.type(activations.dtype)
    # Detached: scan's autograd form fails torch.onnx's decomposition; an export never trains.
    return scan_linear_recurrence((torch.exp(log_a) * ~reset).detach(), normalized.detach(), state)


class _RecurrentGemma:
    def _blocks(self, model: Any) -> dict[int, Any]:
        return {i: layer.temporal_block for i, layer in enumerate(backbone(model).layers)
                if hasattr(layer.temporal_block, "rg_lru")}

    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dtype = next(model.parameters()).dtype
        return {layer: {"conv0": ((config.lru_width, config.conv1d_width - 1), dtype),
                        "recurrent0": ((config.lru_width,), torch.float32)} for layer in self._blocks(model)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> _Binding:
        binding = _Binding()
        binding.use_cache = False  # the attention layers' KV is kvforge's; the blocks' states are bound below
        layer_of = {id(block): layer for layer, block in self._blocks(model).items()}

        def forward(block: Any, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any = None,
                    use_cache: bool = True, **kwargs: Any) -> tuple[torch.Tensor, None]:
            # Griffin's recurrent block, continuing the row: the short convolution runs over the previous
            # conv1d_width - 1 inputs and the new ones (HF's prefill restarts it from zeros), then the RG-LRU.
            layer = layer_of[id(block)]
            seq = input_states.shape[1]
            y_branch = block.act_fn(block.linear_y(input_states))
            x_branch = block.linear_x(input_states).transpose(1, 2)
            full = torch.cat([_fresh(past[(layer, "conv0")], past_lens).to(x_branch.dtype), x_branch], dim=-1)
            binding.present[(layer, "conv0")] = full[..., seq:]
            conv = block.conv_1d
            x_branch = torch.nn.functional.conv1d(full, conv.weight, conv.bias, groups=conv.groups)
            x_branch, state = _rglru(block.rg_lru, x_branch.transpose(1, 2), position_ids,
                                     _fresh(past[(layer, "recurrent0")], past_lens))
            binding.present[(layer, "recurrent0")] = state
            return block.linear_out(x_branch * y_branch), None

        block_class = type(next(iter(self._blocks(model).values())))
        binding.patch(block_class, "forward", forward)
        return binding


# ------------------------------------------------------------------------------------------------ xLSTM (mLSTM)
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


class _Xlstm:
    def probe(self, model: Any) -> StateShapes:
        config = model.config
        dtype = getattr(torch, config.inference_state_dtype)
        # The layers' own widths (config.qk_head_dim rounds the width up to a multiple of 64; the layers do not).
        layer = backbone(model).blocks[0].mlstm_layer
        qk, v = layer.qk_dim // config.num_heads, layer.v_dim // config.num_heads
        shapes = ((config.num_heads, qk, v), (config.num_heads, qk), (config.num_heads, 1))
        return {layer: {kind: (shape, dtype) for kind, shape in zip(_XLSTM_KINDS, shapes, strict=True)}
                for layer in range(config.num_hidden_layers)}

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> _Binding:
        from types import SimpleNamespace

        module = sys.modules[type(model).__module__]
        binding = _Binding()
        # use_cache=False: HF then neither builds its own cache nor counts positions in it, yet still reads and
        # writes (copy_, into these fresh tensors) the rnn_state of the cache it is given.
        binding.use_cache = False
        rnn_state = {layer: tuple(_fresh(past[(layer, kind)], past_lens) for kind in _XLSTM_KINDS)
                     for layer in range(model.config.num_hidden_layers)}
        binding.kwargs = {cache_keyword(model): SimpleNamespace(rnn_state=rnn_state)}
        for layer, states in rnn_state.items():
            binding.present.update({(layer, kind): state for kind, state in zip(_XLSTM_KINDS, states, strict=True)})
        binding.patch(module.xLSTMBackend, "forward", _mlstm_backend_forward)
        # HF splits a prompt longer than max_inference_chunksize with a Python loop: a trace would fix the length.
        binding.patch(model.config, "max_inference_chunksize", sys.maxsize)
        return binding


FAMILIES: dict[str, Any] = {"rwkv": _Rwkv(), "minimax": _MiniMax(), "recurrent_gemma": _RecurrentGemma(),
                            "xlstm": _Xlstm()}


def own_state_family(model: Any) -> Any | None:
    """The family adapter for a model whose recurrent state lives outside transformers' cache, else None."""
    return FAMILIES.get(getattr(model.config, "model_type", None))


def probe_own_states(model: Any) -> StateShapes | None:
    """layer -> {kind: (shape of one row, dtype)} for a model of FAMILIES (None for any other model)."""
    family = own_state_family(model)
    return None if family is None else family.probe(model)


def bind_own_states(model: Any, past: dict[tuple[int, str], torch.Tensor],
                    past_lens: torch.Tensor) -> _Binding | None:
    """For one traced call of a model of FAMILIES: its state inputs bound where the model reads them (None for
    any other model). Use as a context manager around the backbone's call, then `present_state`."""
    family = own_state_family(model)
    return None if family is None else family.bind(model, past, past_lens)


def present_state(binding: _Binding, layer: int, kind: str) -> torch.Tensor | None:
    """What the call wrote for (layer, kind); None if it wrote nothing."""
    found = binding.present.get((layer, kind))
    return found.resolve() if isinstance(found, _Lazy) else found
