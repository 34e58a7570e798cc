"""What HF's attention actually receives, per layer: one tiny eager forward with a recording attention
function. The config's head counts are a family's convention (num_key_value_heads, num_kv_heads,
multi_query, ...); the shapes HF hands to attention are the truth the KV cache must follow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvforge.core.errors import UnsupportedModelError

PROBE_IMPLEMENTATION = "kvforge_probe"
# What transformers' attention functions receive that kvforge's op models (or that does not change the
# result): the scale, window and softcap are the op's attributes, the rest is bookkeeping.
KNOWN_ARGUMENTS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "position_ids", "cache_position",
                             "is_causal", "output_attentions", "use_cache", "position_embeddings", "past_key_values",
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

    from kvforge.exporter.wrapper import backbone

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


def uniform_shape(model: Any, num_layers: int) -> LayerShape:
    """The one attention shape every layer has (`sinks`: whether any layer has attention sinks), or
    UnsupportedModelError naming what differs."""
    seen = probe_attention(model)
    model_type = model.config.model_type
    if not seen:
        raise UnsupportedModelError(f"{model_type}: {OWN_ATTENTION}")
    if len(seen) < num_layers:
        missing = sorted(set(range(num_layers)) - set(seen))
        raise UnsupportedModelError(
            f"{model_type}: layers {missing[:8]} call no attention (recurrent, state-space or linear-attention "
            "layers); kvforge exports models whose every layer attends through a KV cache")
    shapes = {dataclasses.replace(shape, sinks=False) for shape in seen.values()}
    if len(shapes) > 1:
        raise UnsupportedModelError(
            f"{model_type}: the layers' attention shapes differ ({', '.join(sorted(map(_describe, shapes)))}); "
            "kvforge's KV cache has one head count and head size for every layer")
    shape = dataclasses.replace(shapes.pop(), sinks=any(layer.sinks for layer in seen.values()))
    if shape.value_dim != shape.head_dim:
        raise UnsupportedModelError(
            f"{model_type}: keys have {shape.head_dim} dims per head but values {shape.value_dim} (as in multi-head "
            "latent attention); kvforge's KV cache holds keys and values of one head size")
    return shape


def _describe(shape: LayerShape) -> str:
    return f"{shape.num_heads} heads / {shape.kv_heads} KV heads of {shape.head_dim}"
