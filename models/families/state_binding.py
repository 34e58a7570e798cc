"""What the families whose recurrent state lives outside transformers' cache share (models/families/rwkv.py,
minimax.py, recurrent_gemma.py, xlstm.py).

transformers' linear-attention cache layers (Mamba, gated DeltaNet) hand kvforge their states through a cache it
builds (exporter/wrapper.py's `_state_cache`). Some families keep the state elsewhere: RWKV passes a `state` list
through its forward, MiniMax's lightning attention keeps its K^T V matrix in its own `MiniMaxCache`,
RecurrentGemma's RG-LRU blocks keep theirs in module attributes, xLSTM's mLSTM cells in its own `xLSTMCache`.
Each such family's `states` says which states a layer keeps (`probe`) and, for one traced call, binds the graph's
state inputs to where the model reads them and collects what it writes as the present states (`bind`). A state
input reads as a fresh state (the model's own initial value) where the row starts at position 0, so no caller
resets a buffer. Sequence loops become `torch._higher_order_ops.scan`, so the prefill graph keeps a dynamic length.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvforge.models.families.surgery import Patches

StateShapes = dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]


class FamilyStates(Protocol):
    """A family's `states` hook (Family.states): what the export asks of a family whose recurrent state lives outside
    transformers' cache."""

    def probe(self, model: Any) -> StateShapes:
        """Each layer's states, {layer: {kind: (shape past the batch, dtype)}}, from the loaded `model`
        (exporter/probe.py's probe_states)."""
        ...

    def bind(self, model: Any, past: dict[tuple[int, str], torch.Tensor], past_lens: torch.Tensor) -> StateBinding:
        """For one traced call: the graph's past buffers by (layer, kind) bound to where `model` reads its states,
        a row starting afresh where its past_lens is 0 (exporter/wrapper.py)."""
        ...


def fresh(tensor: torch.Tensor, past_lens: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """`tensor` [B, ...] where the row continues, `value` where it starts at position 0."""
    started = (past_lens > 0).view(-1, *([1] * (tensor.dim() - 1)))
    return torch.where(started, tensor, torch.full_like(tensor, value))


class StateBinding(Patches):
    """One traced call's state binding: the backbone's extra keywords, the patches in force during the call
    (entered as a context manager around it), and each (layer, kind)'s present state afterwards."""

    use_cache = True

    def __init__(self) -> None:
        super().__init__()
        self.kwargs: dict[str, Any] = {}
        self.present: dict[tuple[int, str], Any] = {}

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.set(owner, name, value)


class LazyState:
    """A layer's slice of a state stack, taken after the forward has written it."""

    def __init__(self, stacks: list[torch.Tensor], index: int, layer: int) -> None:
        self.stacks, self.index, self.layer = stacks, index, layer

    def resolve(self) -> torch.Tensor:
        return self.stacks[self.index][:, :, self.layer]


def present_state(binding: StateBinding, layer: int, kind: str) -> torch.Tensor | None:
    """What the call wrote for (layer, kind); None if it wrote nothing."""
    found = binding.present.get((layer, kind))
    return found.resolve() if isinstance(found, LazyState) else found
