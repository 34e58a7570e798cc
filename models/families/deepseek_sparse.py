"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, dots3; Qwen4-Exp's block indexer): an
indexer with its own key cache picks which cached positions attention reads. Up to the number it picks, that is
every position, so dense attention over the cache is the same attention there: the indexer is made to pick every
position when attention is routed, and an export's capacity is capped at that number."""

from __future__ import annotations

import functools
import types
from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import Patches, routed

# Why a sparse-attention model reached without this module's patch is refused (the probe's refusal).
REFUSAL = ("DeepSeek sparse attention: an indexer with its own key cache picks the top-k (index_topk) cached positions "
           "per query, which kvforge's dense attention op and KV cache do not model")


def _all_positions(indexer: Any, config: Any, boolean_mask: bool) -> Any:
    """The indexer, picking every cached position when attention is routed. Its picks reach kvforge's op only as
    the `indices` keyword, which the op ignores; an empty tensor keeps HF's "shared" DSA layers (which reuse the
    previous layer's picks) running. A block indexer (Qwen4-Exp) returns the kept positions as a boolean mask:
    all of them. Under HF's own implementations it is HF's indexer."""
    import torch

    class AllPositions(torch.nn.Module):
        picks_all = True  # what the probe's refusal of sparse attention looks for

        def __init__(self) -> None:
            super().__init__()
            self.hf = indexer

        def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not routed(config):
                return self.hf(hidden_states, *args, **kwargs)
            if boolean_mask:
                mask = args[1] if len(args) > 1 else kwargs["attention_mask"]
                return torch.ones_like(mask, dtype=torch.bool)
            return hidden_states.new_zeros((*hidden_states.shape[:2], 0), dtype=torch.int32)

    return AllPositions()


def _attention(self: Any, hidden_states: Any, position_embeddings: Any = None, attention_mask: Any = None,
               *args: Any, **kwargs: Any) -> Any:
    """The DSA attention's own forward, given a mask when routed: HF slices the mask for its indexer before
    calling it, and kvforge's op (which masks by past_lens) may be handed none."""
    if attention_mask is None and routed(self.config):
        batch, seq = hidden_states.shape[:2]
        attention_mask = hidden_states.new_zeros((batch, 1, seq, seq))
    return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)


def _adapt(model: Any, patches: Patches, boolean_mask: bool = False) -> str:
    for module in list(model.modules()):
        if getattr(module, "indexer", None) is not None:
            patches.set(module, "indexer", _all_positions(module.indexer, module.config, boolean_mask))
            patches.set(module, "forward", types.MethodType(_attention, module))
    return "DSA indexers pick every cached position (exact up to index_topk positions)"


def _capacity(config: Any, key: str = "index_topk") -> tuple[int, str] | None:
    topk = getattr(config, key, None)
    if not topk:
        return None
    return int(topk), (f"{config.model_type}: capacity capped at {key}={topk}: its sparse attention attends to the "
                       f"positions its indexer picks, which are all of them up to {key}; beyond, kvforge's dense "
                       "attention would be another model")


_NOTES = "DeepSeek sparse attention, its indexer picking every position up to its top-k"
FAMILIES = (
    *(Family(name, (), _NOTES, capacity=_capacity, patch=_adapt)
      for name in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text")),
    # Qwen4-Exp's indexer keeps the best indexer_budget / compress_ratio blocks of compress_ratio positions (and the
    # incomplete block at the end): every position while a row holds at most indexer_budget of them.
    Family("qwen4_exp_text", (), _NOTES, capacity=functools.partial(_capacity, key="indexer_budget"),
           patch=functools.partial(_adapt, boolean_mask=True)),
)
