"""Adapts a HF encoder-decoder to kvforge's three graphs (kvforge/core/encoder_contract.py).

HF's modules compute projections, norms and positions; the registered attention function routes each attention
module by its part (models/encoder_decoders.py `roles`):

- the encoder's own attention and the decoder's cross attention go through `torch.ops.kvforge.cross_attention`,
  masked to each row's encoder length; the decoder's cross attention reads the graph's cross keys and values, so
  the projections HF computes from a stand-in encoder state are left unused (and removed with the unused nodes);
- the decoder's self attention goes through kvforge's cache op as a decoder-only model's does (exporter/wrapper.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface

from kvforge.exporter import wrapper as decoder_only
from kvforge.plugins import cross_op  # noqa: F401  (registers torch.ops.kvforge.cross_attention)

ATTN_IMPLEMENTATION = "kvforge_seq2seq"
_TRACING: dict[str, Any] = {}  # "state": the _Seq2SeqState of the wrapper call being traced


class _Seq2SeqState:
    def __init__(self, roles: dict[int, tuple[str, int]], encoder_lens: torch.Tensor,
                 cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.roles, self.encoder_lens, self.cross = roles, encoder_lens, cross


def seq2seq_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None,
                      position_bias: torch.Tensor | None = None, **kwargs: Any) -> Any:
    state = _TRACING.get("state")
    if state is None:
        raise RuntimeError("kvforge encoder-decoder attention called outside an export wrapper")
    role, layer = state.roles.get(id(module), (None, -1))
    if role == "self":
        return decoder_only.kvforge_attention(module, query, key, value, attention_mask, scaling, **kwargs)
    if role is None:
        raise RuntimeError(f"attention module {type(module).__name__} has no part in the family's layout")
    if role == "cross":
        # (T5 hands its cross attention a zero bias; the decoder's self attention gets the family's, over the cache.)
        key, value = state.cross[layer]
        position_bias = None
    batch, heads, seq, head_dim = query.shape
    scale = float(scaling if scaling is not None else head_dim ** -0.5)
    out = torch.ops.kvforge.cross_attention(query.transpose(1, 2).reshape(batch, seq, heads * head_dim),
                                            key, value, state.encoder_lens, position_bias, heads, scale)
    return out.view(batch, seq, heads, head_dim), None


AttentionInterface.register(ATTN_IMPLEMENTATION, seq2seq_attention)


class _Routed:
    """While open: the model's attention is kvforge's and `state` is the call's (restored after, so the same
    model still serves as the eager reference)."""

    def __init__(self, model: torch.nn.Module, state: _Seq2SeqState, cache: Any = None) -> None:
        self.configs = {id(c): c for c in _configs(model)}.values()
        self.state, self.cache = state, cache

    def __enter__(self) -> None:
        self.saved = [(c, c._attn_implementation) for c in self.configs]
        for config, _ in self.saved:
            config._attn_implementation = ATTN_IMPLEMENTATION
        _TRACING["state"] = self.state
        if self.cache is not None:
            decoder_only._TRACING["state"] = self.cache

    def __exit__(self, *_: Any) -> None:
        for config, value in self.saved:
            config._attn_implementation = value
        _TRACING.pop("state", None)
        decoder_only._TRACING.pop("state", None)


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every config the model's modules read their attention implementation from (T5's stacks hold copies)."""
    return [module.config for module in model.modules() if hasattr(module, "config")] + [model.config]


@contextlib.contextmanager
def _per_row_positions(model: torch.nn.Module, family: Any, rows: torch.Tensor) -> Iterator[None]:
    """While open: the decoder's positions table gives the rows' own positions `rows` [B, S] (past_lens[b] + t), not
    HF's one offset per batch. A family without a table (family.positions None: T5) is left as it is."""
    if family.positions is None:
        yield
        return
    table = model.get_decoder().embed_positions
    positions = family.positions(model, rows)
    saved_forward = table.forward
    table.forward = lambda *_args, **_kwargs: positions
    try:
        yield
    finally:
        table.forward = saved_forward


class EncoderWrapper(torch.nn.Module):
    """forward(encoder_input_ids, encoder_lens) or forward(input_features) -> (encoder_hidden_states, cross_key.0,
    cross_value.0, ...): the encoder once, and each decoder layer's cross keys and values [B, H, T, D]."""

    def __init__(self, model: torch.nn.Module, family: Any) -> None:
        super().__init__()
        self.model, self.family = model, family
        self.heads, self.head_dim = family.heads(model.config)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        encoder = self.model.get_encoder()
        if self.family.input == "ids":
            ids, lens = inputs
            mask = (torch.arange(ids.shape[1])[None, :] < lens.to(torch.int64)[:, None]).to(torch.int64)
            call = dict(input_ids=ids, attention_mask=mask)
        else:  # Whisper: every row is one 30 s window, all of its frames real; fp32 features in at every dtype
            call, lens = dict(input_features=inputs[0].to(self.model.dtype)), None
        roles = self.family.roles(self.model)
        if lens is None:
            steps = self.model.config.max_source_positions
            lens = torch.full((inputs[0].shape[0],), steps, dtype=torch.int32)
        with _Routed(self.model, _Seq2SeqState(roles, lens)):
            hidden = encoder(**call).last_hidden_state
        batch, length = hidden.shape[:2]
        cross = []
        for k_proj, v_proj in self.family.cross(self.model):
            for projection in (k_proj, v_proj):
                cross.append(projection(hidden).view(batch, length, self.heads, self.head_dim).transpose(1, 2))
        return (hidden, *cross)


class DecoderWrapper(torch.nn.Module):
    """forward(input_ids, past_lens, [logits_index,] encoder_lens, *cross, *past) -> (logits, *present): the decoder
    of an encoder-decoder under the decoder-only graph's contract, with the encoder's length and cross keys and
    values as inputs (encoder_contract.decoder_io)."""

    def __init__(self, model: torch.nn.Module, family: Any, phase: str = "prefill") -> None:
        super().__init__()
        self.model, self.family, self.phase = model, family, phase
        self.layers = family.decoder_layers(model.config)

    def forward(self, input_ids: torch.Tensor, past_lens: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits_index, rest = (rest[0], rest[1:]) if self.phase == "prefill" else (None, rest)
        encoder_lens, rest = rest[0], rest[1:]
        cross_flat, past_flat = rest[: 2 * self.layers], rest[2 * self.layers:]
        cross = [(cross_flat[2 * i], cross_flat[2 * i + 1]) for i in range(self.layers)]
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(self.layers)]
        cache = decoder_only._CacheState(past, past_lens)
        rows = past_lens.to(torch.int64)[:, None] + torch.arange(input_ids.shape[1], dtype=torch.int64)
        decoder = self.model.get_decoder()
        # A stand-in for the encoder's states: HF projects it into cross keys the attention then ignores (it reads
        # the graph's), so only its shape matters.
        key = cross[0][0]
        stand_in = key.new_zeros(key.shape[0], key.shape[2], self.model.config.d_model)
        if self.family.self_bias is not None:  # T5: a relative bias over the cache, not a positions table
            cache.attention_bias = self.family.self_bias(self.model, rows, past[0][0].shape[2])
        with _per_row_positions(self.model, self.family, rows), \
                _Routed(self.model, _Seq2SeqState(self.family.roles(self.model), encoder_lens, cross), cache):
            hidden = decoder(input_ids=input_ids, encoder_hidden_states=stand_in, use_cache=False).last_hidden_state
        if logits_index is None:
            selected = hidden[:, -1, :]
        else:
            selected = torch.gather(hidden, 1, logits_index[:, :, None].expand(-1, -1, hidden.shape[-1]))
        logits = self.family.logits(self.model, selected).float()
        present = [tensor for layer in range(self.layers) for tensor in cache.present[layer]]
        return (logits, *present)
