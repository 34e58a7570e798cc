"""Where a loaded Hugging Face causal LM keeps its decoder stack, the keyword that stack takes its cache by, and
the cache layer that leaves the KV cache to kvforge's op: read by the probe, the export wrapper and the families
whose state lives outside transformers' cache."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack under the LM head: `base_model` (`model` for most families, `transformer` for
    GPT-2), or its `model` where the class's base_model_prefix names no attribute (Llama 4's text LM)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the backbone takes its cache by: `cache` (transformers >= 5.24's name) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(backbone(model).forward).parameters else "past_key_values"


@functools.cache
def pass_through_layer() -> type:
    """A transformers cache layer class that hands attention its new keys and values unchanged (kvforge's op keeps
    the KV cache) and reports an empty cache, so masks cover the call's own positions only."""
    from transformers.cache_utils import CacheLayerMixin

    class PassThrough(CacheLayerMixin):
        is_sliding = False
        # Qwen4-Exp keeps its indexer's position history here; its indexer is adapted away (models/adapters.py),
        # and within one call the positions are the call's own.
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
