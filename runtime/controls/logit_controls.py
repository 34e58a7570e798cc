"""Per-row logit processing before a token is picked: the penalties of SamplingConfig, then a
grammar's mask. Only rows that need it get a RowControls; the plain path stays vectorised.

The grammar hook is duck-typed: `Generator.grammar_matcher(spec)` returns a per-row matcher with
    apply(logits_row: np.ndarray[V] float32) -> None   # sets the disallowed tokens to -inf, in place
    advance(token: int) -> None                        # the token the row took
(runtime/controls/constraint.py builds them with llguidance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvforge.core.errors import GrammarError
from kvforge.runtime.controls.sampling import SamplingConfig


class RowControls:
    """The penalties and grammar matcher of one row: `apply` before picking, `advance` after."""

    def __init__(self, config: SamplingConfig, prompt: Sequence[int], matcher: Any | None = None) -> None:
        self.config = config
        self.matcher = matcher
        self.prompt = list(prompt)
        self.counts: np.ndarray | None = None  # generated tokens per id (presence / frequency)
        self.seen: np.ndarray | None = None  # ids in the prompt or generated (repetition)

    def apply(self, row: np.ndarray) -> None:
        """Penalise, then mask, one row [V] of logits in place (float32, a copy of the backend's)."""
        config = self.config
        if config.repetition_penalty != 1:
            if self.seen is None:
                self.seen = np.zeros(row.shape[-1], dtype=bool)
                self.seen[self.prompt] = True
            hit = row[self.seen]
            row[self.seen] = np.where(hit < 0, hit * config.repetition_penalty, hit / config.repetition_penalty)
        if config.presence_penalty != 0 or config.frequency_penalty != 0:
            if self.counts is None:
                self.counts = np.zeros(row.shape[-1], dtype=np.float32)
            row -= config.frequency_penalty * self.counts + config.presence_penalty * (self.counts > 0)
        if self.matcher is not None:
            self.matcher.apply(row)
            if not np.isfinite(row).any():
                raise GrammarError("the grammar allows no token at this step (its matcher masked every token)")

    def advance(self, token: int) -> None:
        if self.seen is not None:
            self.seen[token] = True
        elif self.config.repetition_penalty != 1:
            self.prompt.append(token)  # not applied yet: the history waits for the first apply
        if self.counts is not None:
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.advance(token)
