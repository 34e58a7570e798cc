"""Log-probabilities of the chosen tokens and of the most likely alternatives, per step.

They are `log_softmax` of the export's raw logits: before penalties, the grammar mask, temperature
and the top-k / top-p / min-p filters (what vLLM returns by default), so they describe the model,
not the sampling settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20  # alternatives per step at most (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its natural-log probability and the `top` most likely tokens of that
    step as (token id, logprob) pairs, most likely first (ties by token id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, top: int, rows: Iterable[int]) -> dict[int, TokenLogprob]:
    """TokenLogprob of tokens[b] under raw [B, V] logits[b], with `top` alternatives, for each b in `rows`."""
    out = {}
    for b in rows:
        logp = log_softmax(logits[b])
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            ids = np.argpartition(-logp, top - 1)[:top]
            ids = ids[np.lexsort((ids, -logp[ids]))]
            best = tuple((int(i), float(logp[i])) for i in ids)
        token = int(tokens[b])
        out[b] = TokenLogprob(token, float(logp[token]), best)
    return out
