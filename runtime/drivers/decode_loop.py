"""The step loop of one Generator request: prefill once, then decode (or verify speculative
drafts) over the slot's in-place KV cache until every row has finished.

Batches of prompts with different lengths are right-padded: prefill returns the logits at
`logits_index[b] = len(prompt_b) - 1`, then `past_lens[b] = len(prompt_b)`. The padding's K/V rows
beyond a prompt are overwritten by that row's next decode steps before anything attends them.
Finished rows are frozen: they are fed the pad token at an unchanged `past_lens[b]` and ignored.
"""

from __future__ import annotations

import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvforge.core.errors import GrammarError
from kvforge.runtime.controls.logprobs import TokenLogprob
from kvforge.runtime.controls.request import FinishReason, GenerationRequest
from kvforge.runtime.drivers.engine import Accepted, StepEngine
from kvforge.runtime.drivers.rows import Row
from kvforge.runtime.text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    """Per-prompt lists (in prompt order) and timings of the whole request."""

    tokens: list[list[int]]  # generated ids only, including the EOS / stop token that ended a row
    text: list[str] | None  # decoded generated text (before any stop string); None when the prompts were token ids
    prompt_tokens: list[int]
    finish_reason: list[FinishReason]  # EOS | STOP | LENGTH (str values "eos" | "stop" | "length")
    ttft_ms: float  # request start to first token (tokenize + prefill + sample)
    prefill_ms: float
    decode_ms: float
    decode_tokens_per_s: float  # tokens of running rows produced by decode steps / decode time
    steps: int  # decode graph runs (decode + verification runs with speculation)
    draft_tokens: int = 0  # speculation: tokens drafted and checked
    accepted_tokens: int = 0  # speculation: drafted tokens the target kept
    # speculation, per draft position j (0-based): drafts that reached it, and those kept through it
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    verify_steps: int = 0  # speculation: the target's verification calls

    @property
    def tokens_per_step(self) -> float:
        """Tokens the rows took per target graph run after the prefill (1.0 without speculation)."""
        return sum(map(len, self.tokens)) / self.steps if self.steps else 0.0
    # keep_logits=True: one float32 [B, V] array per step (step 0 = prefill); rows that had
    # finished hold logits of their pad-token feed, not meaningful
    logits: list[np.ndarray] | None = None
    # logprobs=k: per row, one TokenLogprob per generated token (runtime/controls/logprobs.py)
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class StepEvent:
    """One token per row. Step 0 is the token sampled from the prefill logits."""

    step: int
    token_ids: list[int | None]  # None for rows that had already finished
    text: list[str] | None  # stable text delta per row ("" when held back); None for token-id prompts
    finished: list[bool]
    logprobs: list[TokenLogprob | None] | None = None  # logprobs=k: per row, None where token_ids is None


Steps = PyGenerator[StepEvent, None, GenerationResult]


class GenerationStream:
    """Iterate for StepEvents; `result` holds the GenerationResult once the iteration has ended."""

    def __init__(self, events: Steps) -> None:
        self._events = events
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StepEvent]:
        self._result = yield from self._events

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet; iterate it to the end first")
        return self._result


@dataclass
class _Counts:
    decode_s: float = 0.0
    decoded_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add_runs(self, runs: list[tuple[int, int]]) -> None:
        for drafted, accepted in runs:
            if len(self.drafted_at) < drafted:
                grow = drafted - len(self.drafted_at)
                self.drafted_at += [0] * grow
                self.accepted_at += [0] * grow
            for j in range(drafted):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < accepted


def run_steps(engine: StepEngine, request: GenerationRequest, prompts: list[list[int]], tokenizer: Tokenizer | None,
              text_mode: bool, report_text: bool, start: float) -> Steps:
    """The events of one request whose rows are placed on `engine` (row b: prompts[b]); returns its
    GenerationResult. `tokenizer`: decodes the rows' text at the end (text_mode); `report_text`: the
    events carry each row's text delta (streamed text)."""
    batch = len(prompts)
    keep_logits = request.keep_logits
    kept_logits: list[np.ndarray] = []
    rows = [engine.rows[b] for b in range(batch)]
    t_prefill = time.perf_counter()
    step = engine.prefill(prompts)
    prefill_ms = (time.perf_counter() - t_prefill) * 1e3
    if keep_logits:
        kept_logits.append(step.logits.copy())  # the backend reuses its logits buffer every run
    logprobs = request.logprobs is not None
    grammar = request.grammar is not None
    if grammar:
        _raise_grammar_failure(rows)
    event = _event(0, rows, step.positions[0], report_text, logprobs)
    ttft_ms = (time.perf_counter() - start) * 1e3
    yield event

    counts = _Counts()
    speculation = request.speculation
    while engine.any_running():
        t_step = time.perf_counter()
        step = None
        if speculation is not None:
            step = engine.verify({at: rows[at].room(speculation.draft_len, request.max_new_tokens)
                                  for at in range(batch)})
        if step is not None:
            counts.drafted += step.drafted
            counts.accepted += step.accepted_drafts
            counts.verify_steps += 1
            counts.add_runs(step.runs)
        else:
            step = engine.decode(keep_logits=keep_logits)
            if keep_logits:
                kept_logits.append(step.logits.copy())
        if grammar:
            _raise_grammar_failure(rows)
        counts.decoded_tokens += step.tokens
        events = [_event(engine.steps, rows, accepted, report_text, logprobs) for accepted in step.positions]
        counts.decode_s += time.perf_counter() - t_step
        yield from events

    text = None
    if text_mode:
        assert tokenizer is not None
        if request.stop:
            text = [row.stopper.text for row in rows]  # the text ends before a stop string
        else:
            text = [tokenizer.decode(row.tokens) for row in rows]
    return GenerationResult(
        tokens=[row.tokens for row in rows],
        text=text,
        prompt_tokens=[len(p) for p in prompts],
        finish_reason=[FinishReason(row.reason) for row in rows],
        ttft_ms=ttft_ms,
        prefill_ms=prefill_ms,
        decode_ms=counts.decode_s * 1e3,
        decode_tokens_per_s=counts.decoded_tokens / counts.decode_s if counts.decode_s > 0 else 0.0,
        steps=engine.steps,
        draft_tokens=counts.drafted,
        accepted_tokens=counts.accepted,
        drafted_at=counts.drafted_at,
        accepted_at=counts.accepted_at,
        verify_steps=counts.verify_steps,
        logits=kept_logits if keep_logits else None,
        logprobs=[row.logprobs for row in rows] if request.logprobs is not None else None,
    )


def _raise_grammar_failure(rows: list[Row]) -> None:
    """A Generator request fails as a whole when a row's grammar fails (the server's Scheduler ends only
    that row: its other requests are someone else's)."""
    for row in rows:
        if row.error is not None:
            raise GrammarError(row.error)


def _event(step: int, rows: list[Row], accepted: list[Accepted], report_text: bool, logprobs: bool) -> StepEvent:
    """The StepEvent of the rows `accepted` took a token in (the others: None)."""
    batch = len(rows)
    tokens: list[int | None] = [None] * batch
    deltas = [""] * batch if report_text else None
    step_logprobs: list[TokenLogprob | None] | None = [None] * batch if logprobs else None
    for item in accepted:
        tokens[item.at] = item.token
        if deltas is not None:
            deltas[item.at] = item.delta
        if step_logprobs is not None:
            step_logprobs[item.at] = item.logprob
    return StepEvent(step=step, token_ids=tokens, text=deltas, finished=[row.stopper.reason is not None for row in rows],
                     logprobs=step_logprobs)
