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

Requests are GenerationRequests (runtime/controls/request.py) with one prompt; they end with the same
FinishReasons as the Generator's rows, decided by the same Stopper. Torch-free. The scheduler never
touches a buffer: rows move through the backend's row operations (runtime/backends/backend.py: copy_rows,
read_rows / write_rows, view_rows), on the backend's device, so it serves on every backend that has them.

Speculation (runtime/drivers/scheduler_speculation.py): each request drafts with its own proposer (prompt
lookup, the scheduler's draft export, the export's head) or none, by its `speculation` or the scheduler's
default (`speculate=`); rows with and without drafts run in one batch, the drafts verified in prefill calls.

A request with n > 1 choices is prefilled once, then its KV rows are copied into n free rows (it
waits until n are free); each choice has its own sampler (seed + i), Stopper, penalties / grammar
matcher (runtime/controls/logit_controls.py) and `index` in its Delta and Done events.

Prompt log-probabilities (OpenAI's echo with logprobs: `score`) are a prefill-only job of this thread, run on
the staging cache between prefill jobs, so in serving only the scheduler touches the backend, and a prompt
scored is held to the same max_seq_len as one generated.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvforge.core.errors import (
    BackendUnavailableError,
    CapacityError,
    InputError,
    KvforgeError,
    QueueFullError,
)
from kvforge.runtime.backends.backend import supports_rows
from kvforge.runtime.controls.logprobs import MAX_LOGPROBS, token_logprobs
from kvforge.runtime.controls.request import FinishReason, GenerationRequest, Stopper
from kvforge.runtime.controls.sampling import choice_seed
from kvforge.runtime.controls.speculate import DEFAULT_DRAFT_LEN
from kvforge.runtime.drivers.engine import Accepted, Step, StepEngine
from kvforge.runtime.drivers.handles import Delta, Done, Event, RequestHandle
from kvforge.runtime.drivers.image_blocks import block_token, chunk_end, prefix_end
from kvforge.runtime.drivers.loaded_export import LoadedExport
from kvforge.runtime.drivers.prefix_store import PrefixStore
from kvforge.runtime.drivers.rows import Picker, Row
from kvforge.runtime.drivers.scheduler_jobs import Job as _Request
from kvforge.runtime.drivers.scheduler_speculation import Speculator
from kvforge.runtime.text.prompts import is_int

DEFAULT_MAX_SEQ_LEN = 4096
__all__ = ["DEFAULT_MAX_SEQ_LEN", "Delta", "Done", "Event", "PrefixStore", "RequestHandle", "Scheduler"]


class Scheduler:
    """Continuous batching over a loaded export's backend (see the module docstring). Start it with
    `start()` (a daemon thread) and stop it with `close()`."""

    def __init__(self, export: LoadedExport | Any, max_batch: int = 8, max_seq_len: int | None = None, prefill_chunk: int = 128,
                 max_queue: int = 64, prefix_cache_bytes: int = 256 << 20, keep_cancelled: bool = False,
                 speculate: str | None = None, draft_len: int = DEFAULT_DRAFT_LEN, draft: Any = None,
                 adaptive: bool = True) -> None:
        """`export`: a LoadedExport (a Generator is taken for its `export`). `keep_cancelled`: a cancelled
        request's KV rows are kept for reuse, as a finished one's are (`kvforge chat`, whose interrupted answer
        stays in the conversation; a server's cancelled request is gone with its client). `speculate` (a method,
        runtime/controls/speculate.py) and `draft_len`: the speculation of requests that name none (one with
        Speculation("off") opts out); `draft`: a draft export (folder, LoadedExport or DraftModel) for method
        "draft"; `adaptive`: each speculative row's draft length follows its acceptance, within 1..draft_len."""
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self.export: LoadedExport = getattr(export, "export", export)
        self.backend = self.export.backend
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
        self.keep_cancelled = keep_cancelled
        if not supports_rows(self.backend):
            raise BackendUnavailableError(f"serving needs a backend with row operations (copy_rows, read_rows, "
                                          f"write_rows, view_rows); backend {self.backend.name!r} has none")
        self.slot = self.backend.allocate(max_batch, self.capacity)
        self.stage = self.backend.allocate(1, self.capacity)
        self.engine = StepEngine(self.backend, self.slot, self.export.pad_token_id, self.export.check_logits)
        self.stats: dict[str, Any] = {}
        draft = draft if draft is not None else getattr(export, "draft", None)  # a Generator's draft export
        self.speculation = Speculator(self.export, self.engine, self.stats, speculate, draft_len, draft, adaptive)
        # Decode slots by batch bucket, each over the first rows of self.slot's buffers (same memory);
        # a backend that cannot view rows runs the whole batch for every bucket.
        buckets = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self._decode_slots = {k: self.slot if k == max_batch else (self.backend.view_rows(self.slot, k) or self.slot)
                              for k in buckets}
        self.prefixes = PrefixStore(prefix_cache_bytes, exact_only=not limits.rollback)
        self.eos = self.export.eos_token_ids
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prefilling: _Request | None = None
        self._scoring: collections.deque[tuple[list[int], int, Future]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._cut: str | None = None  # cut(): the message every request now ends with
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.stats.update({"requests": 0, "completion_tokens": 0, "prefilled_tokens": 0, "cached_tokens": 0,
                      "decode_steps": 0, "decode_tokens": 0, "ttft_ms_sum": 0.0, "ttft_count": 0, "decode_seconds": 0.0,
                      "rejected": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      "rows_failed": 0, "prefix_store_errors": 0})  # one request's own failures (it ends alone)

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
        if self._thread is None:  # never started: no loop is there to end what waits, so it ends here
            return self._fail_all(self._cut or "the scheduler was closed before it started", FinishReason.CANCELLED)
        self._thread.join(timeout=30)

    def cut(self, message: str) -> None:
        """End every request in flight or waiting now, each with a CANCELLED Done carrying `message`,
        and refuse new ones with it: a server stopping cuts its requests itself, so that each gets an
        answer and a log line before the process ends."""
        with self._cond:
            self._cut = message
            self._cond.notify_all()

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None] | None = None) -> RequestHandle:
        """Queue a request (one prompt). Raises InputError / CapacityError for a request that can never
        run and QueueFullError when `max_queue` requests already wait."""
        unsupported = [name for name, given in (("capacity", request.capacity is not None),
                                                ("keep_logits", request.keep_logits)) if given]
        if unsupported:
            raise InputError(f"the scheduler does not take {', '.join(unsupported)} (the server's cache has "
                             "max_seq_len positions per request)")
        speculation, proposer = self.speculation.resolve(request)
        rows, _, images = self.export.prompt_inputs(request)  # images are read and encoded here, on the caller
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
        # Text is always decoded (the server sends it, whatever form the prompt came in); each choice draws
        # from its own stream (seed + i).
        tokenizer = self.export.tokenizer
        sampling = request.sampling
        choices = [Row(prompt, Stopper(request, self.eos, tokenizer.incremental() if tokenizer is not None else None),
                       self.export.row_controls(request, prompt), index=index) for index in range(request.n)]
        pickers = [Picker(sampling.with_overrides(seed=choice_seed(sampling.seed, index)), logprobs=request.logprobs)
                   for index in range(request.n)]
        row_images = images[0] if images else None
        for row in choices if row_images is not None else ():
            row_images.attach(row)
        key = self.export.images.key(prompt, row_images) if row_images is not None else None
        job = _Request(handle, prompt, choices, pickers, row_images, key, proposer,
                       self.speculation.rows(speculation, proposer, request.n))
        with self._cond:
            if self._closed or self._cut is not None:
                raise KvforgeError(self._cut or "the scheduler is closed")
            if len(self._waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (max_queue {self.max_queue})")
            self._waiting.append(job)
            self.stats["requests"] += 1
            self._cond.notify_all()
        return handle

    def score(self, ids: list[int], top: int = 0) -> Future:
        """The log-probabilities of a prompt's tokens (Generator.prompt_logprobs' values: None for the first, then
        each token's with the `top` most likely), computed by the scheduler's thread: a Future of the list."""
        if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise InputError(f"top must be an integer in 0..{MAX_LOGPROBS}, got {top!r}")
        ids = self.export.checked_ids(ids)
        if len(ids) > self.capacity:
            raise CapacityError(f"the prompt ({len(ids)} tokens) needs {len(ids)} positions; this server holds "
                                f"{self.capacity} per request")
        done: Future = Future()
        if len(ids) == 1:  # nothing predicts the first token: no graph run
            done.set_result([None])
            return done
        with self._cond:
            if self._closed or self._cut is not None:
                raise KvforgeError(self._cut or "the scheduler is closed")
            self._scoring.append((ids, int(top), done))
            self._cond.notify_all()
        return done

    def snapshot(self) -> dict[str, Any]:
        """Gauges and counters for /metrics."""
        with self._cond:
            out = dict(self.stats)
            out["drafted_at"], out["accepted_at"] = list(self.speculation.drafted_at), list(self.speculation.accepted_at)
            out["target_steps"] = self.engine.steps
            out["waiting"] = len(self._waiting) + (self._prefilling is not None)
            out["running"] = sum(row is not None for row in self.engine.rows)
            out["prefix_entries"] = len(self.prefixes)
            out["prefix_bytes"] = self.prefixes.bytes
        return out

    # -- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and self._prefilling is None and \
                        not self._scoring and not any(self.engine.rows):
                    self._cond.wait()
                if self._closed:
                    break
                cut = self._cut
            if cut is not None:
                self._fail_all(cut, reason=FinishReason.CANCELLED)
                continue
            try:
                self._score_one()
                self._prefill_chunk()
                self._decode_step()
            except Exception as err:  # a backend failure ends every request in flight, not the server
                message = str(err) if isinstance(err, KvforgeError) else f"{type(err).__name__}: {err}"
                self._fail_all(message)
        self._fail_all(self._cut or "the server is shutting down", reason=FinishReason.CANCELLED)

    def _score_one(self) -> None:
        """One scoring job, on the staging cache while no request is being prefilled there."""
        if self._prefilling is not None:
            return
        with self._cond:
            if not self._scoring:
                return
            ids, top, done = self._scoring.popleft()
        if not done.set_running_or_notify_cancel():
            return
        try:
            self.stage.cache.past_lens[0] = 0
            positions = np.arange(len(ids) - 1, dtype=np.int64)[None]
            logits = self.export.check_logits(self.backend.prefill(self.stage, np.array([ids], np.int64), positions), 0)
            scored = token_logprobs(np.array(logits[0]), np.asarray(ids[1:]), top, range(len(ids) - 1))
            done.set_result([None, *(scored[i] for i in range(len(ids) - 1))])
        except Exception as err:  # noqa: BLE001 - the caller's error, not the batch's
            done.set_exception(err)

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        with self._cond:
            rows = [(at, row) for at, row in enumerate(self.engine.rows) if row is not None]
            waiting = [row for job in self._waiting for row in job.rows]
            if self._prefilling is not None:
                waiting += self._prefilling.rows
            self._waiting.clear()
            self._prefilling = None
            scoring = list(self._scoring)
            self._scoring.clear()
        for _ids, _top, done in scoring:
            if done.set_running_or_notify_cancel():
                done.set_exception(KvforgeError(message))
        for at, row in rows:
            self.engine.release(at)
            self._finish(row, -1, reason, error=message, keep=False)
        for row in waiting:
            self._finish(row, -1, reason, error=message, keep=False)

    def _prefill_chunk(self) -> None:
        if self._prefilling is None:
            with self._cond:
                if not self._waiting or len(self.engine.free_rows()) < self._waiting[0].request.n:
                    return
                job = self._waiting.popleft()
            if job.handle.cancelled.is_set():
                for row in job.rows:
                    self._finish(row, -1, FinishReason.CANCELLED, keep=False)
                return
            self._prefilling = job
            # A head reads the target's hidden states of every prompt position: a reused prefix has none.
            cached, kv = self.prefixes.lookup(job.key) if not job.needs_hidden else (0, None)
            if cached:
                self.backend.write_rows(self.stage, 0, kv, cached)
            cached = prefix_end(job.prompt_ids, cached, block_token(self.export))  # image blocks stay whole
            job.cached = job.prefilled = cached
            self.stage.cache.past_lens[0] = cached
            self.stage.cache.rope_deltas[0] = job.images.rope_delta if job.images is not None else 0
        job = self._prefilling
        if job.handle.cancelled.is_set():
            self._prefilling = None
            for row in job.rows:
                self._finish(row, -1, FinishReason.CANCELLED, keep=False)
            return
        prompt = job.prompt_ids
        end = chunk_end(prompt, job.prefilled, job.prefilled + self.prefill_chunk, block_token(self.export))
        chunk = prompt[job.prefilled: end]
        logits = self.export.check_logits(
            self.backend.prefill(self.stage, np.array([chunk], np.int64), np.array([len(chunk) - 1], np.int64),
                                 job.chunk_images(self.export.images, len(chunk)), job.chunk_positions(len(chunk))), 0)
        if job.needs_hidden:
            job.hidden.append(np.array(self.backend.target_hidden(self.stage)))  # valid until the next run: a copy
        job.prefilled += len(chunk)
        self.stage.cache.past_lens[0] = job.prefilled
        if job.prefilled < len(prompt):
            return
        free = self.engine.free_rows()  # n were free when it started, and only this thread takes rows
        placements = list(zip(free, job.rows, job.pickers, strict=False))
        hidden = np.concatenate(job.hidden, axis=1) if job.hidden else None
        job.hidden = []
        with self._cond:
            step = self.engine.admit(placements, self.stage, len(prompt), logits[0], job.proposer, hidden)
        self._prefilling = None
        job.ttft_ms = (time.perf_counter() - job.started) * 1e3
        self.stats["prefilled_tokens"] += len(prompt) - job.cached
        self.stats["cached_tokens"] += job.cached
        self.stats["ttft_ms_sum"] += job.ttft_ms
        self.stats["ttft_count"] += 1
        self._deliver(step.positions)
        self._end_failed(step.failed)

    def _decode_step(self) -> None:
        for at, row in enumerate(self.engine.rows):
            if row is not None and row.owner.handle.cancelled.is_set():
                self._release(at, FinishReason.CANCELLED, keep=self.keep_cancelled)
        with self._cond:
            self.engine.compact()
        live = self.engine.running()
        if not live:
            return
        started = time.perf_counter()
        # Rows 0..len(live)-1 run (packed by compact); the bucket pads with frozen free rows.
        view = self._decode_slots[next(k for k in self._decode_slots if k >= len(live))]
        verified = self.speculation.steps(live, view, self._take)
        advanced = verified[1] if verified is not None else set()
        rest = [at for at in live if at not in advanced]
        if rest:  # the rows no verification advanced: one token each (verified rows frozen in the call)
            speculative = [at for at in rest if self.engine.proposers[at] is not None]
            step = self.engine.decode(view, skip=advanced)
            self.speculation.count(step, speculative, verify=False)
            self._take(step)
        self.stats["decode_steps"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - started

    def _take(self, step: Step) -> None:
        """A decode or verification step's tokens to their requests."""
        self.stats["decode_tokens"] += step.tokens
        self._deliver(step.positions)
        self._end_failed(step.failed)

    # -- one token ----------------------------------------------------------------------------------
    def _deliver(self, positions: list[list[Accepted]]) -> None:
        """Each accepted token to its request as a Delta, position by position; then each row that ended
        is released, once, after its last token. A verification step accepts several tokens of a row
        before any is delivered, so the row is already finished at its first: releasing it there would
        end the request before the rest of its tokens."""
        ended: dict[int, Row] = {}
        broken: dict[int, str] = {}
        for accepted in positions:
            for item in accepted:
                row = item.row
                if item.at in broken:
                    continue
                self.stats["completion_tokens"] += 1
                try:
                    row.owner.handle.emit(Delta([item.token], item.delta,
                                                [item.logprob] if item.logprob is not None else None, row.index))
                except Exception as err:  # noqa: BLE001 - this request's own consumer failed: it ends alone
                    broken[item.at] = f"internal error delivering a token: {type(err).__name__}: {err}"
                    continue
                if row.finished:
                    ended.setdefault(item.at, row)
        for at, message in broken.items():
            self._release(at, FinishReason.ERROR, keep=False, error=message)
        for at, row in ended.items():
            if at not in broken:
                self._release(at, row.reason)

    def _end_failed(self, failed: list[tuple[int, Row]]) -> None:
        """Rows whose own grammar failed end alone, with its error; the batch goes on."""
        for at, _ in failed:
            self._release(at, FinishReason.ERROR)

    def _release(self, at: int, reason: FinishReason, keep: bool = True, error: str | None = None) -> None:
        row = self.engine.rows[at]
        if row is None:  # released already (a grammar failure and a finish in one step): nothing left to end
            return
        try:
            self._finish(row, at, reason, error=error, keep=keep)
        except Exception:  # noqa: BLE001 - its consumer is gone (its Done could not be delivered): it ends here
            self.stats["rows_failed"] += 1
        finally:
            with self._cond:
                self.engine.release(at)

    def _finish(self, row: Row, at: int, reason: FinishReason, error: str | None = None, keep: bool = True) -> None:
        job = row.owner
        if keep and at >= 0 and row.tokens:
            # Positions written for this request: the prompt and every generated token but the last.
            written = job.key + row.tokens[:-1]
            try:
                self.prefixes.store(written, self.backend.read_rows(self.slot, at, len(written)))
            except Exception:  # noqa: BLE001 - only a cache for later requests: this one's answer is whole
                self.stats["prefix_store_errors"] += 1
        if row.error is not None:  # the row's own grammar failed: the client's request, not the server
            error, client_error = row.error, True
        else:
            client_error = False
        spec = job.speculation[row.index]
        job.handle.emit(Done(reason, len(job.prompt_ids), len(row.tokens), job.prefilled - job.cached, job.cached,
                             job.ttft_ms, error, row.index, client_error, *(spec.counts if spec else ())))
