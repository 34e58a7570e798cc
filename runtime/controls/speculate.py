"""Speculative decoding's methods, and prompt lookup's drafts (the proposer that needs no model).

Methods (runtime/drivers/proposers.py runs them): `prompt-lookup` copies from the row's own context; `draft`
runs a smaller export with the target's vocabulary (its int4 export included); `eagle` and `mtp` run the
export's own head graph (draft.onnx: an EAGLE-3 head, or the checkpoint's MTP layer) over the target's hidden
states. The target verifies every draft in one prefill-graph call; runtime/controls/acceptance.py keeps what
greedy decoding (or the target's sampling distribution) would have produced.

The prompt-lookup draft for a row is what followed the most recent earlier occurrence of the row's last n tokens
(n = max_ngram down to 1) in its own context, prompt and generated text alike. The Generator checks
every draft in one prefill-graph call at past_lens > 0; the rest of the cache is discarded by not
advancing past_lens past it.
"""

from __future__ import annotations

import numpy as np

METHODS = ("prompt-lookup", "draft", "eagle", "mtp")
OFF = "off"  # Speculation("off"): this request does not speculate, whatever its Scheduler's default
HEAD_METHODS = ("eagle", "mtp")  # the export's draft.onnx (manifest record "draft": kind eagle3 / mtp)
MAX_DRAFT_LEN = 15  # verification feeds draft_len + 1 positions; TensorRT profiles allow 16
DEFAULT_DRAFT_LEN = 6
DEFAULT_MAX_NGRAM = 3


def prompt_lookup(context: np.ndarray, draft_len: int, max_ngram: int = DEFAULT_MAX_NGRAM) -> np.ndarray:
    """Up to `draft_len` tokens that followed the latest earlier match of the context's last n-gram
    (longest n first); an empty array when nothing matches."""
    size = len(context)
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = context[size - n:]
        # Windows that start before the tail itself and have at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(context[: size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match: what the text just did is likeliest
            return context[start: start + draft_len]
    return context[:0]


def check_speculation(method: str | None, draft_len: int) -> None:
    """Raise ValueError for an unknown method or a draft length out of range (callers reword it)."""
    if method is not None and method not in METHODS and method != OFF:
        raise ValueError(f"unknown speculation method {method!r}; choose one of {', '.join(METHODS)} (or {OFF!r})")
    if isinstance(draft_len, bool) or not isinstance(draft_len, (int, np.integer)) or not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise ValueError(f"draft_len must be an integer in 1..{MAX_DRAFT_LEN}, got {draft_len!r}")


class AdaptiveDraftLength:
    """One row's draft length, adapted to how its drafts fare: one longer after a draft accepted whole (a longer
    one might have been too), one shorter after a draft with a rejection (the tokens past it were wasted work),
    within 1..most. A greedy row's tokens do not depend on it; it only trades verification width for steps."""

    def __init__(self, most: int, start: int | None = None) -> None:
        check_speculation(None, most)
        self.most = int(most)
        self.length = self.most if start is None else max(1, min(self.most, int(start)))

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of this row (`drafted` tokens proposed, the first `accepted` kept); the
        length for its next draft. A draft shorter than asked (prompt lookup found fewer) accepted whole says
        nothing about a longer one: the length stays."""
        if drafted <= 0:
            return self.length
        if accepted >= drafted:
            if drafted >= self.length:
                self.length = min(self.most, self.length + 1)
        else:
            self.length = max(1, self.length - 1)
        return self.length
