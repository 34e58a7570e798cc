"""One row's verification: the tokens a row keeps from the target's logits at its draft's positions.

A row that picks through its Picker (sampling, penalties, a grammar, logprobs) is verified position by
position: the row's controls see each kept token before the next position's logits are processed (so a
penalty or a grammar state is what plain decoding would have had there), and the rule of
runtime/controls/acceptance.py decides (greedy: the argmax; sampling: the rejection rule). Bare greedy
rows are verified all at once by the engine (an argmax over the block).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvforge.core.errors import GrammarError
from kvforge.runtime.controls.acceptance import draw, keep_drafted, replacement, target_distribution
from kvforge.runtime.controls.logprobs import TokenLogprob, token_logprobs
from kvforge.runtime.drivers.proposers import Draft
from kvforge.runtime.drivers.rows import Picker, Row


class Kept(NamedTuple):
    token: int
    delta: str
    logprob: TokenLogprob | None


def verify_row(row: Row, picker: Picker, logits: np.ndarray, draft: Draft,
               rng: np.random.Generator) -> tuple[list[Kept], int]:
    """Accept into `row` the tokens it keeps from raw logits [W, V] (position j predicts the token after the
    row's last token and draft.tokens[:j]). Returns them and how many drafted tokens were among them."""
    config = picker.sampler.config
    kept: list[Kept] = []
    accepted = 0
    tokens = draft.tokens
    for j in range(len(tokens) + 1):
        if row.finished:
            break
        processed = logits[j]
        if row.controls is not None:
            processed = processed.copy()
            try:
                row.controls.apply(processed)
            except GrammarError as err:
                row.fail(err)
                break
        drafted = int(tokens[j]) if j < len(tokens) else None
        if config.greedy:
            token = int(processed.argmax())
            matched = token == drafted
        else:
            p = target_distribution(processed, config)
            q = draft.probs[j] if draft.probs is not None and drafted is not None else None
            if drafted is None:
                token, matched = draw(p, rng), False
            elif keep_drafted(p, drafted, q, rng):
                token, matched = drafted, True
            else:
                token, matched = replacement(p, drafted, q, rng), False
        logprob = None
        if picker.top is not None:
            logprob = token_logprobs(logits[j][None], np.array([token]), picker.top, [0])[0]
        kept.append(Kept(token, row.accept(token, logprob), logprob))
        if not matched:
            break
        accepted += 1
    return kept, accepted
