"""Continuous batching for serving: requests join and leave one running batch between decode steps.

One batch cache of `max_batch` rows holds the running requests, packed into its first rows. A
decode step is one graph run over only the first `k` rows, `k` the smallest batch bucket (1, 2, 4,
8, ..., max_batch) holding the running requests: every running request advances by one token, the
free rows up to `k` are fed the pad token at a frozen `past_lens` (written, never read). Each bucket
has its own binding over the leading rows of the same buffers (`backend.view_rows`: a view, no
copy per step), so a lone request runs a batch of 1, as `Generator.generate` does. A new request is
prefilled alone on a one-row staging cache, in chunks of `prefill_chunk` tokens with a decode step
of the running batch between chunks (so a long prompt does not stall the others), then its KV rows
are copied into the first free row of the batch cache. A finished request frees its row at once;
before the next decode step the last running row moves into the hole (its written positions and
`past_lens`, a copy once per finished request, not per step), so the running rows stay packed.

Multi-turn reuse: when a request ends, the KV rows of its tokens (prompt + generated, except the
last token, which was never fed back) are kept in a `PrefixStore` bounded in bytes (least recently
used first out). A later prompt that starts with the same tokens, as the next turn of a chat does,
copies those rows and prefills only what follows: the KV of position t depends only on tokens
0..t, so the result is the same as prefilling everything.

Requests are GenerationRequests (runtime/request.py) with one prompt; they end with the same
FinishReasons as the Generator's rows, decided by the same Stopper. Torch-free. The scheduler never
touches a buffer: rows move through the backend's row operations (runtime/backend.py: copy_rows,
read_rows / write_rows, view_rows), on the backend's device, so it serves on every backend that has them.

Speculation (a request with `speculation`, greedy only): while it is the only running request,
each step drafts up to draft_len tokens by prompt lookup (runtime/speculate.py) and verifies them in
one prefill call on the one-row bucket at its past_lens, as `Generator.generate` does; it keeps the
matching prefix plus the token after it, so the tokens are those of plain greedy decoding. While
other requests run, it is decoded in the batch like any other (one token per step): verifying a
single row would stall the others, and the `ort` target verifies one row per call.

A request with n > 1 choices is prefilled once, then its KV rows are copied into n free rows (it
waits until n are free); each choice has its own sampler (seed + i), Stopper, penalties / grammar
matcher (runtime/logit_controls.py) and `index` in its Delta and Done events.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.core.errors import (
    BackendUnavailableError,
    CapacityError,
    InputError,
    KvforgeError,
    QueueFullError,
)
from kvforge.runtime.backend import supports_rows
from kvforge.runtime.generator import Generator
from kvforge.runtime.logit_controls import RowControls
from kvforge.runtime.logprobs import TokenLogprob, token_logprobs
from kvforge.runtime.request import FinishReason, GenerationRequest, Stopper
from kvforge.runtime.sampling import Sampler, choice_seed
from kvforge.runtime.sampling import greedy as greedy_tokens
from kvforge.runtime.speculate import prompt_lookup

DEFAULT_MAX_SEQ_LEN = 4096


@dataclass
class Delta:
    """New output of one request: token ids and the stable text they add ("" while held back);
    with request.logprobs, one TokenLogprob per token; `index`: the choice (n > 1)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: int = 0


@dataclass
class Done:
    finish_reason: FinishReason  # EOS | STOP (stop token or string) | LENGTH | CANCELLED | ERROR
    prompt_tokens: int
    completion_tokens: int
    prefilled_tokens: int  # prompt positions actually run through the graph (once for all n choices)
    cached_tokens: int  # prompt positions copied from a previous turn
    ttft_ms: float | None
    error: str | None = None
    index: int = 0  # the choice (n > 1); each choice ends with its own Done


Event = Delta | Done


class RequestHandle:
    """What `Scheduler.submit` returns: iterate it (blocking) for Delta events ending with Done (with
    n > 1 choices, the events of all choices, ending after the n-th Done), or pass `on_event` to
    submit to receive them from the scheduler thread instead."""

    def __init__(self, request: GenerationRequest, request_id: int, on_event: Callable[[Event], None] | None) -> None:
        self.request = request
        self.id = request_id
        self._queue: queue.Queue[Event] | None = None if on_event is not None else queue.Queue()
        self._on_event = on_event if on_event is not None else self._queue.put  # type: ignore[union-attr]
        self.cancelled = threading.Event()
        self.dones: dict[int, Done] = {}  # by choice index
        self.done: Done | None = None  # the last Done, once every choice has ended
        self._seen: list[Event] = []  # the events iterated so far (results() after a partial iteration)
        self._ended = 0  # Done events among them

    def cancel(self) -> None:
        """Stop generating for this request (the client went away); it ends with CANCELLED."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        if isinstance(event, Done):
            self.dones[event.index] = event
            if len(self.dones) == self.request.n:
                self.done = event
        self._on_event(event)

    def __iter__(self) -> Iterator[Event]:
        if self._queue is None:
            raise RuntimeError("this request delivers its events to on_event")
        while self._ended < self.request.n:
            event = self._queue.get()
            self._seen.append(event)
            self._ended += isinstance(event, Done)
            yield event

    def result(self) -> tuple[list[int], str, Done]:
        """Block until the request (n == 1) ends: (token ids, text, Done)."""
        if self.request.n != 1:
            raise InputError(f"this request has n={self.request.n} choices: use results()")
        return self.results()[0]

    def results(self) -> list[tuple[list[int], str, Done]]:
        """Block until every choice ends: (token ids, text, Done) per choice index."""
        for _ in self:
            pass
        tokens: list[list[int]] = [[] for _ in range(self.request.n)]
        text: list[list[str]] = [[] for _ in range(self.request.n)]
        for event in self._seen:
            if isinstance(event, Delta):
                tokens[event.index] += event.token_ids
                text[event.index].append(event.text)
        return [(tokens[i], "".join(text[i]), self.dones[i]) for i in range(self.request.n)]


class PrefixStore:
    """KV rows of finished requests by their token sequence, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = (
            collections.OrderedDict())
        self._ids = itertools.count()
        self.hits = 0

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[np.ndarray, np.ndarray]] | None]:
        """The longest stored prefix of `prompt` (at most len(prompt) - 1 positions: the last prompt
        token is always run, for its logits) and that entry's KV (rows beyond it are not used)."""
        best, best_key = 0, None
        tokens = np.asarray(prompt, dtype=np.int64)
        for key, (stored, _) in self._entries.items():
            n = min(len(stored), len(tokens) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(stored[:n] != tokens[:n])
            common = int(differ[0]) if differ.size else n
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        return best, self._entries[best_key][1]

    def store(self, tokens: list[int], kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if size > self.budget_bytes or not tokens:
            return
        new = np.asarray(tokens, dtype=np.int64)
        # An entry that is a prefix of the new one is superseded by it.
        for key, (stored, _kv) in list(self._entries.items()):
            if len(stored) <= len(new) and np.array_equal(stored, new[: len(stored)]):
                self._drop(key)
        self._entries[next(self._ids)] = (new, kv)
        self.bytes += size
        while self.bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        _, kv = self._entries.pop(key)
        self.bytes -= sum(k.nbytes + v.nbytes for k, v in kv)

    def __len__(self) -> int:
        return len(self._entries)


class _Active:
    """A request (one choice of it) being prefilled or decoded. The waiting queue holds choice 0;
    the other choices ride along in its `siblings` until the prefill places them all."""

    def __init__(self, handle: RequestHandle, prompt_ids: list[int], stopper: Stopper, index: int = 0,
                 controls: RowControls | None = None) -> None:
        self.handle = handle
        self.request = handle.request
        self.prompt_ids = prompt_ids
        self.index = index
        sampling = self.request.sampling
        self.sampler = Sampler(sampling.with_overrides(seed=choice_seed(sampling.seed, index)))
        self.controls = controls
        self.siblings: list[_Active] = []
        self.stopper = stopper
        self.tokens: list[int] = []
        self.row = -1
        self.prefilled = 0  # prompt positions in the staging cache
        self.cached = 0
        self.started = time.perf_counter()
        self.ttft_ms: float | None = None


class Scheduler:
    """Continuous batching over `generator`'s backend (see the module docstring). Start it with
    `start()` (a daemon thread) and stop it with `close()`."""

    def __init__(self, generator: Generator, max_batch: int = 8, max_seq_len: int | None = None, prefill_chunk: int = 128,
                 max_queue: int = 64, prefix_cache_bytes: int = 256 << 20) -> None:
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self.generator = generator
        self.backend = generator.backend
        limits = self.backend.limits
        if limits.max_batch is not None and max_batch > limits.max_batch:
            raise InputError(f"max_batch {max_batch} exceeds what backend {self.backend.name} runs ({limits.max_batch})")
        # The batch cache holds max_batch x max_seq_len positions up front (SmolLM2-135M fp32: 45 KiB per
        # position-row), so the default stops at 4096 rather than the model's full context.
        self.capacity = min(limits.max_capacity, DEFAULT_MAX_SEQ_LEN) if max_seq_len is None else int(max_seq_len)
        if not 2 <= self.capacity <= limits.max_capacity:
            raise InputError(f"max_seq_len must be between 2 and the export's {limits.max_capacity}, got {max_seq_len!r}")
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        if not supports_rows(self.backend):
            raise BackendUnavailableError(f"serving needs a backend with row operations (copy_rows, read_rows, "
                                          f"write_rows, view_rows); backend {self.backend.name!r} has none")
        self.slot = self.backend.allocate(max_batch, self.capacity)
        self.stage = self.backend.allocate(1, self.capacity)
        # Decode slots by batch bucket, each over the first rows of self.slot's buffers (same memory);
        # a backend that cannot view rows runs the whole batch for every bucket.
        buckets = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self._decode_slots = {k: self.slot if k == max_batch else (self.backend.view_rows(self.slot, k) or self.slot)
                              for k in buckets}
        self.prefixes = PrefixStore(prefix_cache_bytes)
        self.pad = generator.pad_token_id
        self.eos = generator.eos_token_ids
        self._waiting: collections.deque[_Active] = collections.deque()
        self._prefilling: _Active | None = None
        self._running: list[_Active | None] = [None] * max_batch
        self._cond = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "completion_tokens": 0, "prefilled_tokens": 0, "cached_tokens": 0,
                      "decode_steps": 0, "decode_tokens": 0, "ttft_ms_sum": 0.0, "ttft_count": 0, "decode_seconds": 0.0,
                      "rejected": 0, "draft_tokens": 0, "accepted_tokens": 0}

    # -- public -------------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvforge-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None] | None = None) -> RequestHandle:
        """Queue a request (one prompt). Raises InputError / CapacityError for a request that can never
        run and QueueFullError when `max_queue` requests already wait."""
        unsupported = [name for name, given in (("capacity", request.capacity is not None),
                                                ("keep_logits", request.keep_logits)) if given]
        if unsupported:
            raise InputError(f"the scheduler does not take {', '.join(unsupported)} (the server's cache has "
                             "max_seq_len positions per request)")
        rows, _ = self.generator.prompt_ids(request)
        if len(rows) != 1:
            raise InputError(f"the scheduler runs one prompt per request, got {len(rows)}")
        if request.n > self.max_batch:
            raise InputError(f"n={request.n} choices need {request.n} batch rows at once; this server runs "
                             f"{self.max_batch} (max_batch)")
        prompt = rows[0]
        needed = len(prompt) + request.max_new_tokens - 1
        if needed > self.capacity:
            raise CapacityError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                                f"needs {needed} positions; this server holds {self.capacity} per request")
        handle = RequestHandle(request, next(self._ids), on_event)
        # Text is always decoded (the server sends it, whatever form the prompt came in).
        tokenizer = self.generator.tokenizer
        choices = [_Active(handle, prompt,
                           Stopper(request, self.eos, tokenizer.incremental() if tokenizer is not None else None),
                           index, self.generator.row_controls(request, prompt)) for index in range(request.n)]
        choices[0].siblings = choices[1:]
        with self._cond:
            if self._closed:
                raise KvforgeError("the scheduler is closed")
            if len(self._waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (max_queue {self.max_queue})")
            self._waiting.append(choices[0])
            self.stats["requests"] += 1
            self._cond.notify_all()
        return handle

    def snapshot(self) -> dict[str, Any]:
        """Gauges and counters for /metrics."""
        with self._cond:
            out = dict(self.stats)
            out["waiting"] = len(self._waiting) + (self._prefilling is not None)
            out["running"] = sum(a is not None for a in self._running)
            out["prefix_entries"] = len(self.prefixes)
            out["prefix_bytes"] = self.prefixes.bytes
        return out

    # -- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and self._prefilling is None and not any(self._running):
                    self._cond.wait()
                if self._closed:
                    break
            try:
                self._prefill_chunk()
                self._decode_step()
            except Exception as err:  # a backend failure ends every request in flight, not the server
                message = str(err) if isinstance(err, KvforgeError) else f"{type(err).__name__}: {err}"
                self._fail_all(message)
        self._fail_all("the server is shutting down", reason=FinishReason.CANCELLED)

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        with self._cond:
            active = [a for a in self._running if a is not None]
            active += [c for a in self._waiting for c in (a, *a.siblings)]
            if self._prefilling is not None:
                active += [self._prefilling, *self._prefilling.siblings]
            self._running = [None] * self.max_batch
            self._waiting.clear()
            self._prefilling = None
        for a in active:
            self._finish(a, reason, error=message if reason == FinishReason.ERROR else None, keep=False)

    def _free_row(self) -> int | None:
        return next((r for r, a in enumerate(self._running) if a is None), None)

    def _free_rows(self) -> int:
        return sum(a is None for a in self._running)

    def _prefill_chunk(self) -> None:
        if self._prefilling is None:
            with self._cond:
                if not self._waiting or self._free_rows() < self._waiting[0].request.n:
                    return
                active = self._waiting.popleft()
            if active.handle.cancelled.is_set():
                for choice in (active, *active.siblings):
                    self._finish(choice, FinishReason.CANCELLED, keep=False)
                return
            self._prefilling = active
            prompt = active.prompt_ids
            cached, kv = self.prefixes.lookup(prompt)
            if cached:
                self.backend.write_rows(self.stage, 0, kv, cached)
            active.cached = active.prefilled = cached
            self.stage.cache.past_lens[0] = cached
        active = self._prefilling
        if active.handle.cancelled.is_set():
            self._prefilling = None
            for choice in (active, *active.siblings):
                self._finish(choice, FinishReason.CANCELLED, keep=False)
            return
        prompt = active.prompt_ids
        chunk = prompt[active.prefilled: active.prefilled + self.prefill_chunk]
        logits = self.generator.check_logits(
            self.backend.prefill(self.stage, np.array([chunk], np.int64), np.array([len(chunk) - 1], np.int64)), 0)
        active.prefilled += len(chunk)
        self.stage.cache.past_lens[0] = active.prefilled
        if active.prefilled < len(prompt):
            return
        choices = [active, *active.siblings]
        for choice in choices:  # one prefill, its KV rows copied to a free row per choice
            row = self._free_row()
            assert row is not None  # only this thread takes rows, and n were free
            self.backend.copy_rows(self.stage, 0, self.slot, row, len(prompt))
            self.slot.cache.past_lens[row] = len(prompt)
            choice.row, choice.prefilled, choice.cached = row, active.prefilled, active.cached
            with self._cond:
                self._running[row] = choice
        self._prefilling = None
        active.ttft_ms = (time.perf_counter() - active.started) * 1e3
        for choice in active.siblings:
            choice.ttft_ms = active.ttft_ms
        self.stats["prefilled_tokens"] += len(prompt) - active.cached
        self.stats["cached_tokens"] += active.cached
        self.stats["ttft_ms_sum"] += active.ttft_ms
        self.stats["ttft_count"] += 1
        for choice in choices:
            self._accept(choice, *self._pick(choice, logits))

    def _decode_step(self) -> None:
        live = [a for a in self._running if a is not None]
        for a in live:
            if a.handle.cancelled.is_set():
                self._release(a, FinishReason.CANCELLED, keep=False)
        self._compact()
        live = [a for a in self._running if a is not None]
        if not live:
            return
        started = time.perf_counter()
        if len(live) == 1 and live[0].request.speculation is not None and self._speculate(live[0]):
            self.stats["decode_seconds"] += time.perf_counter() - started
            return
        # Rows 0..len(live)-1 run (packed by _compact); the bucket pads with frozen free rows.
        slot = self._decode_slots[next(k for k in self._decode_slots if k >= len(live))]
        feed = np.full(slot.cache.batch, self.pad, dtype=np.int64)
        running = np.zeros(slot.cache.batch, dtype=bool)
        for a in live:
            feed[a.row] = a.tokens[-1]
            running[a.row] = True
        logits = self.generator.check_logits(self.backend.decode(slot, feed, running), 1)
        slot.cache.past_lens[running] += 1  # a view of self.slot's past_lens
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(live)
        for a in live:
            self._accept(a, *self._pick(a, logits[a.row: a.row + 1]))
        self.stats["decode_seconds"] += time.perf_counter() - started

    def _speculate(self, a: _Active) -> bool:
        """One verification step for the lone running request `a` (row 0): its prompt-lookup draft
        fed at past_lens in one prefill call on the one-row bucket; the draft's prefix that greedy
        decoding agrees with and the token after it are accepted (positions written beyond them are
        rewritten before they are read). False when there is no draft (then a plain step runs)."""
        assert a.request.speculation is not None and a.row == 0  # packed: the lone request is row 0
        room = min(a.request.speculation.draft_len, a.request.max_new_tokens - len(a.tokens) - 1)
        if room < 1:
            return False
        draft = prompt_lookup(np.array(a.prompt_ids + a.tokens, dtype=np.int64), room)
        if not len(draft):
            return False
        block = np.array([[a.tokens[-1], *draft]], dtype=np.int64)
        index = np.arange(block.shape[1], dtype=np.int64)[None]
        slot = self._decode_slots[1]
        picked = greedy_tokens(self.generator.check_logits(self.backend.prefill(slot, block, index), 1))[0]
        n = 0
        while n < len(draft) and picked[n] == draft[n]:
            n += 1
        slot.cache.past_lens[0] += n + 1
        self.stats["decode_steps"] += 1
        self.stats["draft_tokens"] += len(draft)
        self.stats["accepted_tokens"] += n
        for token in picked[: n + 1]:
            if a.stopper.reason is not None:  # a stop token or string ended it within the accepted run
                break
            self.stats["decode_tokens"] += 1
            self._accept(a, int(token))
        return True

    def _compact(self) -> None:
        """Move the last running row into the first free row below it until the running rows are
        rows 0..n-1: its written positions and past_lens (the moved-from row is then free, frozen at 0)."""
        past_lens = self.slot.cache.past_lens
        while True:
            free = self._free_row()
            last = max((r for r, a in enumerate(self._running) if a is not None), default=-1)
            if free is None or free > last:
                return
            moved = self._running[last]
            assert moved is not None
            n = int(past_lens[last])
            self.backend.copy_rows(self.slot, last, self.slot, free, n)
            past_lens[free], past_lens[last] = n, 0
            moved.row = free
            with self._cond:
                self._running[free], self._running[last] = moved, None

    # -- one token ----------------------------------------------------------------------------------
    def _pick(self, a: _Active, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """`a`'s next token from its raw [1, V] logits (penalties and grammar on a copy), and its logprobs."""
        processed = logits
        if a.controls is not None:
            processed = logits.copy()  # the backend reuses its buffer; logprobs read the raw logits
            a.controls.apply(processed[0])
        token = int(a.sampler(processed)[0])
        if a.request.logprobs is None:
            return token, None
        return token, token_logprobs(logits, np.array([token]), a.request.logprobs, [0])[0]

    def _accept(self, a: _Active, token: int, logprob: TokenLogprob | None = None) -> None:
        a.tokens.append(token)
        if a.controls is not None:
            a.controls.advance(token)
        self.stats["completion_tokens"] += 1
        a.handle.emit(Delta([token], a.stopper.add(token), [logprob] if logprob is not None else None, a.index))
        if a.stopper.reason is not None:
            self._release(a, a.stopper.reason)

    def _release(self, a: _Active, reason: FinishReason, keep: bool = True) -> None:
        with self._cond:
            if a.row >= 0 and self._running[a.row] is a:
                self._running[a.row] = None
        self._finish(a, reason, keep=keep)

    def _finish(self, a: _Active, reason: FinishReason, error: str | None = None, keep: bool = True) -> None:
        if keep and a.row >= 0 and a.tokens:
            # Positions written for this request: the prompt and every generated token but the last.
            written = a.prompt_ids + a.tokens[:-1]
            n = len(written)
            self.prefixes.store(written, self.backend.read_rows(self.slot, a.row, n))
        if a.row >= 0:
            self.slot.cache.past_lens[a.row] = 0
        a.handle.emit(Done(reason, len(a.prompt_ids), len(a.tokens), a.prefilled - a.cached, a.cached,
                           a.ttft_ms, error, a.index))
