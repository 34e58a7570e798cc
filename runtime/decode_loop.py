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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvforge.runtime.backend import Slot
from kvforge.runtime.logit_controls import RowControls
from kvforge.runtime.logprobs import TokenLogprob, token_logprobs
from kvforge.runtime.request import FinishReason, GenerationRequest, Stopper
from kvforge.runtime.sampling import Sampler, choice_seed
from kvforge.runtime.sampling import greedy as greedy_tokens
from kvforge.runtime.speculate import prompt_lookup
from kvforge.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvforge.runtime.generator import Generator


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
    accepted_tokens: int = 0  # speculation: drafted tokens that greedy decoding agreed with
    # keep_logits=True: one float32 [B, V] array per step (step 0 = prefill); rows that had
    # finished hold logits of their pad-token feed, not meaningful
    logits: list[np.ndarray] | None = None
    # logprobs=k: per row, one TokenLogprob per generated token (runtime/logprobs.py)
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


class _Rows:
    """Per-row state: the tokens generated so far, each row's Stopper, and which rows still run."""

    def __init__(self, request: GenerationRequest, prompts: list[list[int]], eos_ids: frozenset[int],
                 tokenizer: Tokenizer | None, report_text: bool, controls: list[RowControls] | None = None) -> None:
        self.prompts = prompts
        self.controls = controls
        self.logprobs: list[list[TokenLogprob]] | None = [[] for _ in prompts] if request.logprobs is not None else None
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.stoppers = [Stopper(request, eos_ids, tokenizer.incremental() if tokenizer else None) for _ in prompts]
        self.running = np.ones(len(prompts), dtype=bool)
        # The running rows as a list too: the step loop reads it where a numpy call on `running`
        # would cost tens of microseconds with caches cold from the graph run.
        self.live = list(range(len(prompts)))
        self.report_text = report_text

    def accept(self, step: int, picked: np.ndarray, rows: object = None,
               logprobs: dict[int, TokenLogprob] | None = None) -> StepEvent:
        """Append picked[b] (with logprobs[b]) to each running row (or to `rows`) and end the rows it stops."""
        batch = len(self.prompts)
        new: list[int | None] = [None] * batch
        deltas = [""] * batch if self.report_text else None
        step_logprobs: list[TokenLogprob | None] | None = [None] * batch if logprobs is not None else None
        for b in list(self.live) if rows is None else rows:
            token = int(picked[b])
            self.tokens[b].append(token)
            new[b] = token
            if self.controls is not None:
                self.controls[b].advance(token)
            if logprobs is not None and self.logprobs is not None and step_logprobs is not None:
                self.logprobs[b].append(logprobs[b])
                step_logprobs[b] = logprobs[b]
            delta = self.stoppers[b].add(token)
            if self.stoppers[b].reason is not None:
                self.running[b] = False
                self.live.remove(b)
            if deltas is not None:
                deltas[b] = delta
        return StepEvent(step=step, token_ids=new, text=deltas, finished=[s.reason is not None for s in self.stoppers],
                         logprobs=step_logprobs)

    def pick(self, logits: np.ndarray, sampler: Sampler,
             top: int | None) -> tuple[np.ndarray, dict[int, TokenLogprob] | None]:
        """Each row's next token from raw [B, V] logits: penalties and grammar on a copy for the running
        rows that have controls, then the sampler; and the logprobs of the raw logits when asked."""
        processed = logits
        if self.controls is not None:
            processed = logits.copy()  # the raw logits stay for keep_logits and logprobs
            for b in self.live:
                self.controls[b].apply(processed[b])
        picked = sampler(processed)
        if top is None:
            return picked, None
        return picked, token_logprobs(logits, picked, top, np.flatnonzero(self.running))


@dataclass
class _Counts:
    steps: int = 0
    decode_s: float = 0.0
    decoded_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


def run_steps(gen: Generator, slot: Slot, request: GenerationRequest, prompts: list[list[int]], text_mode: bool,
              stream_text: bool, start: float, controls: list[RowControls] | None = None) -> Steps:
    """The events of one request on `slot` (which the caller owns); returns its GenerationResult.
    `prompts` holds request.n rows per prompt (choice i of a prompt at row p * n + i); `controls`:
    each row's penalties / grammar matcher, or None when the request has neither."""
    backend = gen.backend
    batch = len(prompts)
    lens = np.array([len(row) for row in prompts], dtype=np.int64)
    input_ids = np.full((batch, int(lens.max())), gen.pad_token_id, dtype=np.int64)
    for b, row in enumerate(prompts):
        input_ids[b, : len(row)] = row
    # Text is decoded step by step only where it is streamed or stop strings must be found in it.
    incremental = gen.tokenizer is not None and ((text_mode and stream_text) or bool(request.stop))
    rows = _Rows(request, prompts, gen.eos_token_ids, gen.tokenizer if incremental else None,
                 report_text=text_mode and stream_text, controls=controls)
    # n > 1: each choice its own stream, as its own Scheduler choice draws (seed + i); else one for the batch.
    n = request.n
    sampler = Sampler(request.sampling, [choice_seed(request.sampling.seed, b % n) for b in range(batch)]
                      if n > 1 else None)
    top = request.logprobs
    keep_logits = request.keep_logits
    kept_logits: list[np.ndarray] = []

    cache = slot.cache
    cache.reset()
    t_prefill = time.perf_counter()
    logits = gen.check_logits(backend.prefill(slot, input_ids, lens - 1), 0)
    cache.past_lens[:] = lens
    prefill_ms = (time.perf_counter() - t_prefill) * 1e3
    if keep_logits:
        kept_logits.append(logits.copy())  # the backend reuses its logits buffer every run
    picked, logprobs = rows.pick(logits, sampler, top)
    event = rows.accept(0, picked, logprobs=logprobs)
    ttft_ms = (time.perf_counter() - start) * 1e3
    yield event

    counts = _Counts()
    draft_len = request.speculation.draft_len if request.speculation is not None else 0
    feed = np.zeros(batch, dtype=np.int64)
    # Greedy on the raw logits: the NaN check looks at the picked logits only (Generator.check_logits).
    plain_greedy = request.sampling.greedy and controls is None
    # ... and without logprobs the argmax is all a step samples: called directly, not through the
    # Sampler (each call costs microseconds with caches cold from the graph run).
    bare_greedy = plain_greedy and top is None
    while rows.live:
        t_step = time.perf_counter()
        drafts = draft_tokens(rows, draft_len, request.max_new_tokens) if draft_len else None
        if drafts is not None:
            events = _verify_drafts(gen, slot, rows, drafts, counts)
            counts.decode_s += time.perf_counter() - t_step
            yield from events
            continue
        # Finished rows get the pad token at a frozen past_lens: written, never read.
        every_row = len(rows.live) == batch
        if not every_row:
            feed[:] = gen.pad_token_id
        for b in rows.live:
            feed[b] = rows.tokens[b][-1]
        logits = backend.decode(slot, feed, None if every_row else rows.running)
        if not plain_greedy:
            gen.check_logits(logits, counts.steps + 1)
        if every_row:
            cache.past_lens += 1
        else:
            cache.past_lens[rows.running] += 1
        counts.steps += 1
        counts.decoded_tokens += len(rows.live)
        if keep_logits:
            kept_logits.append(logits.copy())
        picked, logprobs = (greedy_tokens(logits), None) if bare_greedy else rows.pick(logits, sampler, top)
        if plain_greedy:
            gen.check_logits(logits, counts.steps, greedy_picks=picked)
        event = rows.accept(counts.steps, picked, logprobs=logprobs)
        counts.decode_s += time.perf_counter() - t_step
        yield event

    text = None
    if text_mode:
        assert gen.tokenizer is not None
        if request.stop:
            text = [stopper.text for stopper in rows.stoppers]  # the text ends before a stop string
        else:
            text = [gen.tokenizer.decode(row) for row in rows.tokens]
    return GenerationResult(
        tokens=rows.tokens,
        text=text,
        prompt_tokens=[int(n) for n in lens],
        finish_reason=[FinishReason(s.reason) for s in rows.stoppers],
        ttft_ms=ttft_ms,
        prefill_ms=prefill_ms,
        decode_ms=counts.decode_s * 1e3,
        decode_tokens_per_s=counts.decoded_tokens / counts.decode_s if counts.decode_s > 0 else 0.0,
        steps=counts.steps,
        draft_tokens=counts.drafted,
        accepted_tokens=counts.accepted,
        logits=kept_logits if keep_logits else None,
        logprobs=rows.logprobs,
    )


def draft_tokens(rows: _Rows, draft_len: int, max_new_tokens: int) -> list[np.ndarray] | None:
    """Each running row's prompt-lookup draft (empty for the others), or None when no row has one.
    A draft never runs past max_new_tokens: the token after it is always produced too."""
    drafts: list[np.ndarray] = []
    for b, prompt in enumerate(rows.prompts):
        tokens = rows.tokens[b]
        room = min(draft_len, max_new_tokens - len(tokens) - 1)
        if not rows.running[b] or room < 1:
            drafts.append(np.empty(0, dtype=np.int64))
            continue
        context = np.fromiter((*prompt, *tokens), dtype=np.int64, count=len(prompt) + len(tokens))
        drafts.append(prompt_lookup(context, room))
    return drafts if any(len(d) for d in drafts) else None


def _verify_drafts(gen: Generator, slot: Slot, rows: _Rows, drafts: list[np.ndarray], counts: _Counts) -> list[StepEvent]:
    """One prefill call checks every row's draft: fed [last token, draft...] at past_lens, logits at
    each fed position. Greedy keeps the draft's matching prefix plus the token after it; positions
    written beyond that are never read before being rewritten."""
    batch = len(rows.prompts)
    width = 1 + max(len(d) for d in drafts)
    block = np.full((batch, width), gen.pad_token_id, dtype=np.int64)
    live = np.flatnonzero(rows.running)
    for b in live:
        block[b, 0] = rows.tokens[b][-1]
        block[b, 1: 1 + len(drafts[b])] = drafts[b]
    index = np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width))
    picked = greedy_tokens(gen.check_logits(gen.backend.prefill(slot, block, index), counts.steps + 1))
    counts.steps += 1
    kept = np.zeros(batch, dtype=np.int64)
    for b in live:
        draft = drafts[b]
        n = 0
        while n < len(draft) and picked[b, n] == draft[n]:
            n += 1
        kept[b] = n + 1
        counts.drafted += len(draft)
        counts.accepted += n
    slot.cache.past_lens[live] += kept[live]
    events = []
    for j in range(int(kept.max())):
        accepting = [b for b in live if rows.running[b] and j < kept[b]]
        if accepting:
            events.append(rows.accept(counts.steps, picked[:, j], accepting))
            counts.decoded_tokens += len(accepting)
    return events
