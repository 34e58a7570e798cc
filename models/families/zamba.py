"""Zamba and Zamba 2: hybrid layers that each call a shared attention block (one module per hybrid layer, its
weights tied across them). The block indexes transformers' cache by the calling layer's number, handed to its
forward, not by its own `layer_idx` (None in Zamba, -1 in Zamba 2); kvforge's op takes the layer from
`module.layer_idx`, so it is set to the calling layer's and each hybrid layer keeps its own keys and values, as in
HF's cache. HF's forward does not read it."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import Patches


def adapt(model: Any, patches: Patches) -> str:
    for index, layer in enumerate(model.model.layers):  # ZambaForCausalLM / Zamba2ForCausalLM: `model` is the stack
        block = getattr(layer, "shared_transf", None) or getattr(layer, "shared_transformer", None)
        if block is not None:
            patches.set(block.self_attn, "layer_idx", index)
    return "each hybrid layer's shared attention block keeps its own keys and values"


FAMILIES = tuple(Family(name, (), "hybrid layers calling a shared attention block", patch=adapt)
                 for name in ("zamba", "zamba2"))
