"""GPT-2: learned absolute positions (no rotary channels), multi-head attention; two attention options HF offers
that kvforge's op does not model are refused."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family


def _refuse(config: Any) -> str | None:
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        return "gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"
    return None


def _no_rotary(config: Any, head_dim: int) -> int:
    return 0


FAMILY = Family("gpt2", ("GPT2LMHeadModel",), "learned absolute positions, multi-head attention, biases, LayerNorm",
                refuse=_refuse, rotary_dims=_no_rotary)
FAMILIES = (FAMILY,)
