"""What HF's attention actually receives, per layer: one tiny eager forward with a recording attention
function. The config's head counts are a family's convention (num_key_value_heads, num_kv_heads,
multi_query, ...); the shapes HF hands to attention are the truth the KV cache must follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.core.errors import UnsupportedModelError

PROBE_IMPLEMENTATION = "kvforge_probe"
# What transformers' attention functions receive that kvforge's op models (or that does not change the
# result): the scale, window and softcap are the op's attributes, the rest is bookkeeping (`indices`: a DSA
# indexer's picks, which reach attention only from an indexer adapted to pick every position; others are refused).
KNOWN_ARGUMENTS = frozenset({"indices", "dropout", "scaling", "sliding_window", "softcap", "position_ids",
                             "cache_position", "is_causal", "output_attentions", "use_cache", "position_embeddings", "past_key_values",
                             "layer_idx", "head_mask", "query_length", "return_dict"})
# What the attention arguments kvforge refuses are, for its message. `s_aux` of one logit per query head
# is the op's `sinks` input; any other form is refused.
ARGUMENT_MEANINGS = {"s_aux": "attention sinks that are not one logit per head", "sinks": "per-token attention sinks",
                     "position_bias": "an additive position bias"}
OWN_ATTENTION = ("its attention is written into its own modeling code, not called through transformers' attention "
                 "interface, which is how kvforge puts its fused attention op in the graph")


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    sinks: bool = False  # the layer's attention has a learned sink logit per head (the op's `sinks` input)

    @property
    def cache_dim(self) -> int:
        """The head size of both cache buffers: the key's (values of fewer dims are zero-padded to it)."""
        return max(self.head_dim, self.value_dim)


def probe_attention(model: Any) -> dict[int, LayerShape]:
    """layer index -> the query/key/value shapes its attention call receives (a 2-token forward)."""
    import torch
    from transformers import AttentionInterface

    seen: dict[int, LayerShape] = {}
    extras: set[str] = set()

    def record(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        sinks = kwargs.pop("s_aux", None)
        if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
            extras.add("s_aux")
        if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
            extras.add("sinks")  # read by the family's own attention function, which kvforge's replaces
        if layer is not None:
            seen[int(layer)] = LayerShape(query.shape[1], key.shape[1], key.shape[-1], value.shape[-1], sinks is not None)
        extras.update(name for name, arg in kwargs.items() if arg is not None and name not in KNOWN_ARGUMENTS)
        # Only shapes matter here: zeros of the output's shape, whatever the layer's options (softcap, sinks).
        batch, heads, seq = query.shape[:3]
        return value.new_zeros(batch, seq, heads, value.shape[-1]), None

    from kvforge.models.families.surgery import backbone

    # An attention module with an `indexer` (DeepSeek-V3.2, GLM-MoE-DSA, MiniMax-M3's sparse layers) attends only
    # to the cached positions the indexer picks: dense attention over the cache would be another model, unless
    # the indexer's patch picks every position (models/families/deepseek_sparse.py, with the capacity capped where that is exact).
    if any(getattr(module, "indexer", None) is not None and not getattr(module.indexer, "picks_all", False)
           for module in model.modules()):
        from kvforge.models.families.deepseek_sparse import REFUSAL

        raise UnsupportedModelError(f"{model.config.model_type}: {REFUSAL}")
    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    config = model.config
    saved, config._attn_implementation = config._attn_implementation, PROBE_IMPLEMENTATION
    try:
        with torch.no_grad():
            backbone(model)(input_ids=torch.tensor([[1, 2]]), use_cache=False)
    except Exception as err:  # a model that does its own attention may fail on an implementation it does not know
        if seen:
            raise
        raise UnsupportedModelError(f"{config.model_type}: {OWN_ATTENTION} (with an unknown attention implementation "
                                    f"its forward fails: {type(err).__name__}: {err})") from err
    finally:
        config._attn_implementation = saved
    if extras:
        named = sorted({ARGUMENT_MEANINGS.get(name, name) for name in extras})
        raise UnsupportedModelError(f"{config.model_type}: its attention uses {', '.join(named)}, which kvforge's "
                                    "attention op does not model")
    return seen


def layer_shapes(model: Any, num_layers: int, stateful: frozenset[int] = frozenset()) -> list[LayerShape | None]:
    """Every layer's attention shape, in layer order (None: a layer of `stateful`, which keeps a recurrent
    state instead and calls no attention), or UnsupportedModelError naming what kvforge cannot cache. Layers
    may differ in head count and head size (Gemma 4's full-attention layers): the KV layout is per layer.
    Keys and values may differ in head size (multi-head latent attention): the cache holds both at the
    key's size (`cache_dim`), the values zero-padded (exporter/wrapper.py)."""
    seen = probe_attention(model)
    model_type = model.config.model_type
    if not seen and not stateful:
        raise UnsupportedModelError(f"{model_type}: {OWN_ATTENTION}")
    missing = sorted(set(range(num_layers)) - set(seen) - stateful)
    if missing:
        raise UnsupportedModelError(
            f"{model_type}: layers {missing[:8]} call no attention and keep no recurrent state that kvforge can "
            "read through transformers' cache (their own recurrent or linear-attention code)")
    shapes = [seen.get(layer) for layer in range(num_layers)]
    wider = sorted({f"{s.value_dim} > {s.head_dim}" for s in shapes if s is not None and s.value_dim > s.head_dim})
    if wider:
        raise UnsupportedModelError(
            f"{model_type}: its values have more dims per head than its keys ({', '.join(wider)}); kvforge's KV "
            "cache holds values at most the keys' head size")
    return shapes


def probe_states(model: Any, family: Any) -> dict[int, dict[str, tuple[tuple[int, ...], Any]]]:
    """layer -> {state kind: (shape of one row, torch dtype)} for the layers whose recurrent state lives in
    transformers' cache (conv and recurrent states of its linear-attention cache layers: Mamba, Mamba 2,
    gated DeltaNet, short convolutions; {} for a layer with nothing to cache, a hybrid's MLP block), from
    one 3-token forward with a cache; a family whose state lives elsewhere (RWKV, MiniMax, RecurrentGemma, xLSTM)
    says its own (its family's `states`: models/families/state_binding.py). Empty for a model with no such layer, or whose cache is its own
    otherwise (then its layers are refused as attending nowhere)."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    from kvforge.models.families.surgery import backbone, cache_keyword
    if family.states is not None:  # RWKV, MiniMax, RecurrentGemma, xLSTM: a state outside transformers' cache
        return family.states.probe(model)
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            backbone(model)(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_keyword(model): cache})
    except Exception:  # noqa: BLE001 - a model with a cache of its own: no states kvforge can bind
        return {}
    states: dict[int, dict[str, tuple[tuple[int, ...], Any]]] = {}
    for layer, entry in enumerate(cache.layers):
        if isinstance(entry, DummyLayer):  # a layer with nothing to cache (an MLP or MoE block of a hybrid)
            states[layer] = {}
        if not isinstance(entry, LinearAttentionCacheLayerMixin):
            continue
        kinds = {f"conv{i}": t for i, t in entry.conv_states.items() if t is not None}
        kinds |= {f"recurrent{i}": t for i, t in entry.recurrent_states.items() if t is not None}
        states[layer] = {kind: (tuple(t.shape[1:]), t.dtype) for kind, t in kinds.items()}
    return states


def _describe(shape: LayerShape) -> str:
    return f"{shape.num_heads} heads / {shape.kv_heads} KV heads of {shape.head_dim}"
