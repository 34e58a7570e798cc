"""Hugging Face surgery shared by the family modules: where a loaded causal LM keeps its decoder stack, the cache
layer that leaves the KV cache to kvforge's op, routing an attention module through transformers' attention
interface, real-valued rotary tables, and `Patches`: every change an export makes to a loaded model or to
transformers' modules, undone when the export ends.

Under transformers' own attention implementations (eager, sdpa, ...) a routed module runs HF's original code,
so a patched model still is HF's model while the patches are in force; after them it is HF's model unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

# What an adapter says it did (the export's progress line).
ROUTED = "attention routed through transformers' attention interface"
REAL_ROTARY = "rotary embedding computed from real cos/sin tables instead of complex numbers (no ONNX form)"
# transformers' own attention implementations: a routed module runs HF's original code under these.
_HF_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention", "flex_attention", "paged")
_MISSING = object()


class Patches(contextlib.ExitStack):
    """The changes one export makes to a loaded model and to transformers' modules, each undone (last first) when
    the stack closes: an attribute set on an instance, a class or a module goes back to what it was, or away
    where it was not its own (an instance's `forward` falls back to its class's again)."""

    def set(self, owner: Any, name: str, value: Any) -> None:
        original = own_attribute(owner, name)
        setattr(owner, name, value)
        self.callback(_restore, owner, name, original)

    def delete_parameter(self, module: Any, name: str) -> None:
        """Drop a module's own parameter (an export holding a weight once), put back when the stack closes."""
        parameter = module._parameters.pop(name)
        self.callback(module._parameters.__setitem__, name, parameter)

    def buffer(self, module: Any, name: str, tensor: Any) -> None:
        """A non-persistent buffer the export adds, removed when the stack closes."""
        original = own_attribute(module, name)
        module.register_buffer(name, tensor, persistent=False)
        self.callback(_restore, module, name, original)


def own_attribute(owner: Any, name: str) -> Any:
    """`owner`'s own value for `name` (its instance dict, or a torch module's parameters, buffers or submodules;
    a class's or module's namespace), or _MISSING where it only inherits one or has none."""
    namespace = vars(owner)
    if name in namespace:
        return namespace[name]
    for store in ("_parameters", "_buffers", "_modules"):
        if name in namespace.get(store, {}):
            return namespace[store][name]
    return _MISSING


def _restore(owner: Any, name: str, original: Any) -> None:
    if original is _MISSING:
        if own_attribute(owner, name) is not _MISSING:
            delattr(owner, name)
    else:
        setattr(owner, name, original)


# -- where the decoder stack is ----------------------------------------------------------------------------------


def backbone(model: Any) -> Any:
    """The decoder stack under the LM head: `base_model` (`model` for most families, `transformer` for
    GPT-2), or its `model` where the class's base_model_prefix names no attribute (Llama 4's text LM)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


def cache_keyword(model: Any) -> str:
    """The keyword the backbone takes its cache by: `cache` (transformers >= 5.24's name) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(backbone(model).forward).parameters else "past_key_values"


@functools.cache
def pass_through_layer() -> type:
    """A transformers cache layer class that hands attention its new keys and values unchanged (kvforge's op keeps
    the KV cache) and reports an empty cache, so masks cover the call's own positions only."""
    from transformers.cache_utils import CacheLayerMixin

    class PassThrough(CacheLayerMixin):
        is_sliding = False
        # Qwen4-Exp keeps its indexer's position history here; its indexer is adapted away
        # (models/families/deepseek_sparse.py), and within one call the positions are the call's own.
        indexer_position_ids = None

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            pass

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length, 0

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return -1

    return PassThrough


# -- routing attention through the interface ---------------------------------------------------------------------


def routed(config: Any) -> bool:
    """Whether attention goes through the interface's function (kvforge's op, its probe) rather than HF's code."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return not implementation.startswith(_HF_IMPLEMENTATIONS)


def interface(config: Any, default: Callable | None = None) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = config._attn_implementation
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default) if default is not None \
        else ALL_ATTENTION_FUNCTIONS[implementation]


def helpers(module: Any) -> types.ModuleType:
    """The modeling file that defines the module's class: its own rotary helpers."""
    return sys.modules[type(module).__module__]


def route(module: Any, canonical: Callable, config: Any, patches: Patches) -> None:
    """module.forward := the canonical call when attention is routed, HF's original forward otherwise."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if routed(config):
            return canonical(module, *args, **kwargs)
        return original(*args, **kwargs)

    patches.set(module, "forward", forward)


# -- complex rotary as its real-valued equivalent ---------------------------------------------------------------


def rotate_pairs(x: Any, cos: Any, sin: Any) -> Any:
    """x rotated as `view_as_real(view_as_complex(x.reshape(..., -1, 2)) * (cos + i sin)).flatten(-2)`: adjacent
    pairs (x[2i], x[2i+1]) times the unit complex number of angle i, in real arithmetic (computed in fp32 as HF
    does, returned in x's dtype). `cos` / `sin` broadcast against x's shape with its last dim halved."""
    import torch

    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RotaryTables(tuple):
    """(cos, sin) [B, S, D/2] of a complex-rotary family's angles (scaled like HF's freqs_cis), with the
    positions they were made for (Llama 4's NoPE layers scale their queries by position)."""

    positions: Any

    def __new__(cls, cos: Any, sin: Any, positions: Any) -> RotaryTables:
        tables = super().__new__(cls, (cos, sin))
        tables.positions = positions
        return tables


def real_rotary(rotary: Any, patches: Patches) -> None:
    """A complex-rotary module (Llama 4's, DeepSeek-V2's: `torch.polar(1, position * inv_freq) * scaling`) made to
    return the same angles as real cos / sin tables (RotaryTables), under every attention implementation."""
    import torch
    from transformers.modeling_rope_utils import dynamic_rope_update

    @dynamic_rope_update  # as HF's forward: dynamic / LongRoPE frequency updates before the tables
    def forward(self: Any, x: Any, position_ids: Any) -> RotaryTables:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return RotaryTables(freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling, position_ids)

    patches.set(rotary, "forward", types.MethodType(forward, rotary))


def real_rotary_attention(model: Any, attention: Callable, patches: Patches) -> str:
    """A complex-rotary family (Llama 4, DeepSeek-V2): its rotary module made to return real tables and every
    layer's attention replaced by `attention`, which rotates pairs in real arithmetic."""
    backbone = model.model
    real_rotary(backbone.rotary_emb, patches)
    for layer in backbone.layers:
        patches.set(layer.self_attn, "forward", types.MethodType(attention, layer.self_attn))
    return REAL_ROTARY
