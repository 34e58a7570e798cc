"""The token protocol, written once for the Generator and the Scheduler: a `Row` is one sequence being
generated (a prompt row of a Generator request, one choice of a served request), a `Picker` is how the
rows of one request pick their next tokens.

    picker = Picker(request.sampling, logprobs=request.logprobs)      # one per request (or per choice)
    picked, logprobs = picker.pick(logits_block, rows)                # raw [len(rows), V] logits, in row order
    delta = row.accept(int(picked[i]), logprobs[i] if logprobs else None)   # text it lets out; row.finished

A row's logit controls (penalties, a grammar's mask) apply to a copy of the raw logits before the
sampler; log-probabilities describe the raw logits (runtime/controls/logprobs.py). A row whose controls fail
(its grammar meets llguidance's limits, or allows no token) ends alone with FinishReason.ERROR and
`row.error`: the other rows of the batch, other requests' included, go on. A picker samples the block of
all its rows, finished ones included: with one random stream for a batch, a finished row still takes
its draw, so a seeded batch draws the same numbers whichever rows end first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.core.errors import GrammarError
from kvforge.runtime.controls.logit_controls import RowControls
from kvforge.runtime.controls.logprobs import TokenLogprob, token_logprobs
from kvforge.runtime.controls.request import FinishReason, Stopper
from kvforge.runtime.controls.sampling import Sampler, SamplingConfig


class Row:
    """One sequence: its prompt, the tokens generated so far (with their log-probabilities when asked),
    its logit controls, and its Stopper, which decides when it ends and what text it lets out."""

    def __init__(self, prompt: Sequence[int], stopper: Stopper, controls: RowControls | None = None,
                 keep_logprobs: bool = False, index: int = 0) -> None:
        self.prompt = list(prompt)
        self.stopper = stopper
        self.controls = controls
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if keep_logprobs else None
        self.index = index  # the choice of its request (n > 1)
        self.owner: object = None  # the driver's own record of the row (the Scheduler's request)
        self.error: str | None = None  # why the row failed (FinishReason.ERROR), a client's grammar
        # A vision-language export's prompt images: their features, one row per image token (contract.IMAGE_FEATURES)
        self.image_features: np.ndarray | None = None
        # An M-RoPE export's prompt: each prompt token's three positions [3, len(prompt)] (contract.POSITION_IDS) and
        # the offset of the row's later positions from past_lens (contract.ROPE_DELTAS); None and 0 for a text row.
        self.positions: np.ndarray | None = None
        self.rope_delta = 0

    def fail(self, error: GrammarError) -> None:
        """End this row alone: its controls failed (the request's own grammar)."""
        self.error = str(error)
        self.stopper.reason = FinishReason.ERROR
        # A grammar fails by outgrowing llguidance's limits: give the memory it grew back to the system
        # (runtime/controls/constraint.py), or the process keeps it for good.
        from kvforge.runtime.controls.constraint import release_free_memory

        release_free_memory()

    @property
    def finished(self) -> bool:
        return self.stopper.reason is not None

    @property
    def reason(self) -> FinishReason | None:
        return self.stopper.reason

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Append `token` (and its logprob), advance the controls; returns the text it lets out."""
        self.tokens.append(token)
        if self.controls is not None:
            try:
                self.controls.advance(token)
            except GrammarError as err:
                self.fail(err)
                return ""
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        return self.stopper.add(token)

    def room(self, draft_len: int, max_new_tokens: int) -> int:
        """How many tokens a speculative step may draft for this row (0 when it has finished): a draft never
        runs past max_new_tokens, the token after it is always produced."""
        return 0 if self.finished else max(0, min(draft_len, max_new_tokens - len(self.tokens) - 1))


class Picker:
    """How the rows of one request pick: its sampling (one random stream for all its rows, or one per row
    for n > 1 choices, see sampling.choice_seed), its rows' controls, and `logprobs` alternatives."""

    def __init__(self, sampling: SamplingConfig, row_seeds: Sequence[int | None] | None = None,
                 logprobs: int | None = None) -> None:
        self.sampler = Sampler(sampling, row_seeds)
        self.top = logprobs
        # Greedy on the raw logits with nothing else to report: an argmax is all a step needs.
        self.bare_greedy = sampling.greedy and logprobs is None

    def pick(self, logits: np.ndarray, rows: Sequence[Row]) -> tuple[np.ndarray, dict[int, TokenLogprob] | None]:
        """Each row's next token from raw logits [len(rows), V] (row i of `logits` is rows[i]'s), and the
        logprobs of the rows still running, by position in `rows`."""
        processed = logits
        live = [i for i, row in enumerate(rows) if not row.finished]
        if any(rows[i].controls is not None for i in live):
            processed = logits.copy()  # the raw logits stay for logprobs (and keep_logits)
            for i in live:
                controls = rows[i].controls
                if controls is not None:
                    try:
                        controls.apply(processed[i])
                    except GrammarError as err:
                        rows[i].fail(err)
                        processed[i] = 0.0  # a finite row for the sampler; the row takes no token
        picked = self.sampler(processed)
        if self.top is None:
            return picked, None
        return picked, token_logprobs(logits, picked, self.top, [i for i in live if not rows[i].finished])
