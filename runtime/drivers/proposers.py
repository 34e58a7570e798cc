"""Speculation's proposers: one interface for every way of drafting tokens, which the step engine
(runtime/drivers/engine.py) asks for drafts and tells what the target kept.

    drafts = proposer.propose(engine, {at: most_tokens})   # batch row -> Draft (tokens, and the distribution
                                                            # each was drawn from when it was sampled)
    ... the target verifies every draft in one prefill-graph call ...
    proposer.observe(engine, {at: (first, count)}, hidden)  # the positions the target kept, with its hidden
                                                            # states there when the proposer reads them
    proposer.release(at); proposer.move(src, dst)           # rows leaving the batch, rows compacted

Prompt lookup (below) copies from the row's context. A draft model (runtime/drivers/draft_model.py) runs a
smaller export over its own KV rows; heads (EAGLE-3, MTP: runtime/drivers/head_proposer.py) run the export's
draft.onnx over the target's hidden states. A proposer holds per-batch-row state, so one serves one engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvforge.runtime.controls.speculate import prompt_lookup


class EngineView(Protocol):
    """What a proposer reads of the step engine (runtime/drivers/engine.py's StepEngine): its rows (Row: prompt,
    tokens), their pickers (sampling settings), its slot and backend, and each row's random stream."""

    rows: list[Any]
    pickers: list[Any]
    slot: Any
    backend: Any

    def rng_of(self, at: int) -> np.random.Generator: ...


class Draft(NamedTuple):
    """Up to k drafted tokens of one row (target vocabulary ids) and, when they were sampled, the distribution
    [k, V] each was drawn from (None: chosen deterministically, which the rejection rule treats as one-hot)."""

    tokens: np.ndarray
    probs: np.ndarray | None = None


EMPTY = Draft(np.empty(0, dtype=np.int64))


class Proposer(Protocol):
    method: str
    needs_hidden: bool  # whether observe() needs the target's hidden states (contract.TARGET_HIDDEN)

    def propose(self, engine: EngineView, wants: Mapping[int, int]) -> dict[int, Draft]: ...

    def observe(self, engine: EngineView, kept: Mapping[int, tuple[int, int]], hidden: np.ndarray | None) -> None: ...

    def release(self, at: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...


def context(engine: EngineView, at: int) -> np.ndarray:
    """Row `at`'s whole context, prompt and generated tokens, as int64."""
    row = engine.rows[at]
    size = len(row.prompt) + len(row.tokens)
    return np.fromiter((*row.prompt, *row.tokens), dtype=np.int64, count=size)


class PromptLookup:
    """Drafts what followed the latest earlier occurrence of the row's last n-gram (runtime/controls/speculate.py)."""

    method = "prompt-lookup"
    needs_hidden = False

    def propose(self, engine: EngineView, wants: Mapping[int, int]) -> dict[int, Draft]:
        drafts = {}
        for at, most in wants.items():
            tokens = prompt_lookup(context(engine, at), most)
            if len(tokens):
                drafts[at] = Draft(tokens)
        return drafts

    def observe(self, engine: EngineView, kept: Mapping[int, tuple[int, int]], hidden: np.ndarray | None) -> None:
        pass

    def release(self, at: int) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass


PROMPT_LOOKUP = PromptLookup()  # stateless: one serves every engine
