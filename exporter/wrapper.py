"""Adapts a HF causal LM to kvforge's graph IO, with attention routed through the fused op.

HF's modules still compute projections, norms and RoPE; the registered attention function
receives q/k/v after RoPE and hands them to `torch.ops.kvforge.kv_cache_attention` together with
this layer's cache. Positions come from `past_lens` inside the graph, per the KV contract.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface

from kvforge.core.contract import KV_KINDS, STATE_KIND, AttentionAttrs, KVLayout
from kvforge.exporter.image_blocks import image_block_ids
from kvforge.exporter.recurrent import note_recurrent_state
from kvforge.models.families import Family, family_for
from kvforge.models.families.state_binding import present_state
from kvforge.models.families.surgery import backbone, cache_keyword, pass_through_layer
from kvforge.plugins import torch_op  # noqa: F401  (registers torch.ops.kvforge.kv_cache_attention)

ATTN_IMPLEMENTATION = "kvforge"


_TRACING: dict[str, Any] = {}  # "state": the _CacheState of the GraphWrapper call being traced


class _CacheState:
    """Per-call side channel: the layers' past buffers in, their present buffers out."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], past_lens: torch.Tensor) -> None:
        self.past = past
        self.past_lens = past_lens
        self.present: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)
        self.block_ids: torch.Tensor | None = None  # image blocks seen both ways (exporter/image_blocks.py)
        self.attention_bias: torch.Tensor | None = None  # [B, H, S, C] added to the scores (T5's relative bias)


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
    value_dim = value.shape[-1]
    if value_dim < head_dim:
        # Multi-head latent attention: values narrower than keys. The cache and the op have one head size, the
        # key's: zero-padded value dims add nothing to any output dim, whose first value_dim are kept below.
        value = torch.nn.functional.pad(value, (0, head_dim - value_dim))
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
        # ALiBi slopes [H] fp32, set on the module by its family module (models/families/alibi.py: BLOOM, MPT).
        getattr(module, "alibi_slopes", None),
        state.block_ids,
        state.attention_bias,  # [B, H, S, C] from the family (T5's relative bias over the cache), or None
        *attrs.as_dict().values(),  # the op's attribute parameters, in AttentionAttrs' field order
    )
    state.present[layer] = (present_key, present_value)
    out = out.view(batch, seq, num_heads, head_dim)
    return (out[..., :value_dim] if value_dim < head_dim else out), None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvforge_attention)


def _state_cache(layout: KVLayout, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> Any:
    """A transformers Cache over the graph's state inputs, for a model with recurrent layers: each such layer's
    conv / recurrent states are the inputs (`has_previous_state`, so the layer continues from them), read as
    zeros (a fresh row) where a row starts at position 0, so no caller ever resets a state buffer; what the
    layer writes is kept as the present state, never written into the input (a traced graph must not mutate
    its inputs). Attention layers pass their new keys and values through unchanged: kvforge's op keeps their
    cache."""
    from transformers.cache_utils import Cache, LinearAttentionLayer

    PassThrough = pass_through_layer()

    class States(LinearAttentionLayer):
        def __init__(self, layer: int) -> None:
            kinds = {kind: int(match[2]) for kind in layout.layer_buffers(layer) if (match := STATE_KIND.match(kind))}
            super().__init__(number_of_states=1 + max(kinds.values()))
            self.present: dict[str, torch.Tensor] = {}
            for kind, index in kinds.items():
                tensor = past[(layer, kind)]
                started = (past_lens > 0).view(-1, *([1] * (tensor.dim() - 1)))
                tensor = torch.where(started, tensor, torch.zeros_like(tensor))
                if kind.startswith("conv"):
                    self.conv_states[index], self.is_conv_states_initialized[index] = tensor, True
                    self.conv_kernel_size[index] = tensor.shape[-1]
                else:
                    self.recurrent_states[index], self.is_recurrent_states_initialized[index] = tensor, True
                self.has_previous_state[index] = True
                self.dtype, self.device = tensor.dtype, tensor.device

        def update_conv_state(self, conv_states, state_idx=0, **kwargs):
            full = torch.cat([self.conv_states[state_idx], conv_states.to(self.conv_states[state_idx].dtype)], dim=-1)
            self.present[f"conv{state_idx}"] = full[..., -self.conv_kernel_size[state_idx]:]
            return full

        def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
            self.present[f"recurrent{state_idx}"] = recurrent_states
            return recurrent_states

    class Both(States, PassThrough):
        pass

    class TraceCache(Cache):
        def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
            state = super().get_recurrent_state(layer_idx, state_idx)
            note_recurrent_state(state)  # Mamba's scan starts from it (exporter/recurrent.py)
            return state

    layers = []
    for layer in range(layout.num_layers):
        stateful = any(STATE_KIND.match(kind) for kind in layout.layer_buffers(layer))
        layers.append(Both(layer) if stateful else PassThrough())
    return TraceCache(layers=layers)


def merge_image_features(input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                         image_token_id: int) -> torch.Tensor:
    """The token embeddings with the image tokens' replaced by `features`, taken in row-major order of the image
    tokens (the contract's IMAGE_FEATURES), as HF's masked_scatter does. An image token beyond the features given
    keeps its own embedding, as in HF's decode: a call with none ([0, hidden]; a decode step through the prefill
    graph, a generated image token) is the text model's. A gather from the features behind one row of zeros."""
    mask = input_ids == image_token_id  # [B, S]
    flat = mask.reshape(-1).to(torch.int64)
    rank = torch.cumsum(flat, 0) * flat  # the k-th image token: k; any other token: 0
    given = (rank > 0) & (rank <= features.shape[0])
    table = torch.cat([features.new_zeros(1, features.shape[-1]), features], 0).to(embeds.dtype)
    picked = table[torch.where(given, rank, torch.zeros_like(rank))].reshape(embeds.shape)
    return torch.where(given.reshape(mask.shape).unsqueeze(-1), picked, embeds)


class GraphWrapper(torch.nn.Module):
    """forward(input_ids, past_lens, [logits_index,] *past) -> (logits, *present)

    `past` is flat: past_key.0, past_value.0, past_key.1, ... ; `present` likewise.
    Prefill returns logits [B, K, V] at positions `logits_index[b, k]` of each row (K = 1 for a
    plain prefill; K > 1 verifies speculative drafts in one call); decode [B, V] at its one position.
    Only the selected positions go through lm_head.
    """

    def __init__(self, model: torch.nn.Module, phase: str, family: Family | None = None,
                 layout: KVLayout | None = None, image_token_id: int | None = None,
                 aux_layers: tuple[int, ...] | None = None, mrope: bool = False, deepstack: int = 0) -> None:
        """`layout`: the cache's buffers, in graph order (default: a key and a value per layer). `image_token_id`:
        a vision-language export's prefill, which takes IMAGE_FEATURES after logits_index (merge_image_features).
        `mrope`: a prefill that takes each token's multimodal positions (contract.POSITION_IDS [3, B, S]) next.
        `deepstack`: the layers that add an image token's further features (Qwen3-VL's DeepStack), which follow its
        embedding in its IMAGE_FEATURES row.
        `aux_layers`: an export with a speculation head, whose graphs also output the inputs of those decoder layers
        concatenated (contract.TARGET_HIDDEN, last; exporter/draft_head.py)."""
        super().__init__()
        if phase not in ("prefill", "decode"):
            raise ValueError(phase)
        self.model = model
        self.phase = phase
        self.family = family if family is not None else family_for(model.config)
        self.layout = layout
        self.image_token_id = image_token_id
        self.aux_layers = aux_layers
        if mrope and phase != "prefill":
            raise ValueError("multimodal positions are a prefill input; decode is derived from prefill")
        self.mrope = mrope
        self.deepstack = deepstack

    def forward(self, input_ids: torch.Tensor, past_lens: torch.Tensor, *rest: torch.Tensor):
        features = None
        if self.phase == "prefill":
            logits_index, past_flat = rest[0], rest[1:]
            if self.image_token_id is not None:
                features, past_flat = past_flat[0], past_flat[1:]
        else:
            logits_index, past_flat = None, rest
        given_positions = None  # contract.POSITION_IDS: an M-RoPE export's prefill (decode derives them)
        if self.mrope:
            given_positions, past_flat = past_flat[0], past_flat[1:]
        layers = self.layout.num_layers if self.layout is not None else len(past_flat) // 2
        buffers = self.layout.buffers() if self.layout is not None else [
            (layer, kind) for layer in range(layers) for kind in KV_KINDS]
        named = dict(zip(buffers, past_flat, strict=True))
        past = [(named[(layer, "key")], named[(layer, "value")]) if (layer, "key") in named else None
                for layer in range(layers)]
        state = _CacheState(past, past_lens)
        state.block_ids = image_block_ids(self, input_ids)  # None unless the family's image tokens attend both ways
        states = self.layout is not None and bool(self.layout.states)
        # A family whose recurrent state lives outside transformers' cache binds it its own way (its `states`).
        own = self.family.states.bind(self.model, named, past_lens) if states and self.family.states else None
        cache = own.kwargs if own is not None else (
            {cache_keyword(self.model): _state_cache(self.layout, named, past_lens)} if states else {})
        seq = input_ids.shape[1]
        position_ids = past_lens.to(torch.int64)[:, None] + torch.arange(seq, dtype=torch.int64) \
            if given_positions is None else given_positions
        # Route attention through the fused op only for this call, so the same model object can
        # still serve as the HF eager reference (parity) afterwards.
        config = self.model.config
        saved, config._attn_implementation = config._attn_implementation, ATTN_IMPLEMENTATION
        _TRACING["state"] = state
        tokens: dict[str, torch.Tensor] = dict(input_ids=input_ids)  # HF's keyword (a vision export: the embeddings)
        if features is not None:
            embeds = self.model.get_input_embeddings()(input_ids)
            width = embeds.shape[-1]
            rows = features[:, :width] if self.deepstack else features
            tokens = dict(inputs_embeds=merge_image_features(input_ids, embeds, rows, self.image_token_id))
            if self.deepstack:  # the family's own text model adds them (its deepstack hook makes that traceable)
                tokens.update(visual_pos_masks=input_ids == self.image_token_id, deepstack_visual_embeds=[
                    features[:, width * (1 + k): width * (2 + k)] for k in range(self.deepstack)])

        try:
            with own if own is not None else contextlib.nullcontext(), \
                    capture_layer_inputs(backbone(self.model), self.aux_layers) as aux:
                hidden = backbone(self.model)(
                    **tokens, position_ids=position_ids, use_cache=own.use_cache if own is not None else bool(cache), **cache
                ).last_hidden_state
        finally:
            config._attn_implementation = saved
            _TRACING.pop("state", None)
        if logits_index is None:
            selected = hidden[:, -1, :]
        else:
            gather = logits_index[:, :, None].expand(-1, -1, hidden.shape[-1])
            selected = torch.gather(hidden, 1, gather)  # [B, K, H]
        head = self.model.get_output_embeddings()
        # Mamba keeps its residual stream in fp32 (residual_in_fp32): the head takes its own dtype, as HF's forward casts.
        logits = self.family.finish_logits(config, head(selected.to(head.weight.dtype))).float()
        present = []
        for layer, kind in buffers:
            if kind in KV_KINDS:
                present.append(state.present[layer][KV_KINDS.index(kind)])
            elif own is not None:
                written = present_state(own, layer, kind)
                present.append(named[(layer, kind)] if written is None else written)
            else:  # a state the layer did not write this call is passed on as it was
                layer_cache = cache[cache_keyword(self.model)].layers[layer]
                present.append(layer_cache.present.get(kind, named[(layer, kind)]))
        return (logits, *present) + ((torch.cat(aux, -1),) if self.aux_layers else ())


@contextlib.contextmanager
def capture_layer_inputs(stack: Any, layer_ids: tuple[int, ...] | None) -> Iterator[list[torch.Tensor]]:
    """While open, the hidden state entering each decoder layer of `layer_ids` (of `stack.layers`) is appended to the
    yielded list, in layer order: the aux states an EAGLE-3 head reads (models/eagle3.py says why inputs)."""
    captured: dict[int, torch.Tensor] = {}
    found: list[torch.Tensor] = []
    handles = []
    for layer in layer_ids or ():
        def keep(_module: Any, args: tuple, kwargs: dict, layer: int = layer) -> None:
            captured[layer] = args[0] if args else kwargs["hidden_states"]
        handles.append(stack.layers[layer].register_forward_pre_hook(keep, with_kwargs=True))
    try:
        yield found
        found.extend(captured[layer] for layer in sorted(layer_ids or ()))
    finally:
        for handle in handles:
            handle.remove()
