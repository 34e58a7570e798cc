"""Generator: prefill once, then decode in a loop over the preallocated, in-place KV cache.

Batches of prompts with different lengths are right-padded: prefill returns the logits at
`logits_index[b] = len(prompt_b) - 1`, then `past_lens[b] = len(prompt_b)`. The padding's K/V rows
beyond a prompt are overwritten by that row's next decode steps before anything attends them.
Finished rows are frozen: they are fed the pad token at an unchanged `past_lens[b]` and ignored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.errors import CapacityError, InputError, NumericalError
from kvforge.manifest import load_manifest
from kvforge.runtime.backend import Backend, Slot, create_backend, default_backend
from kvforge.runtime.kv_cache import CacheState, choose_capacity, needed_positions
from kvforge.runtime.sampling import Sampler, SamplingConfig
from kvforge.runtime.sampling import greedy as greedy_tokens
from kvforge.runtime.speculate import DEFAULT_DRAFT_LEN, check_speculation, prompt_lookup
from kvforge.runtime.tokenizer import TOKENIZER_FILE, IncrementalDetokenizer, Tokenizer

Prompts = str | list[str] | list[int] | list[list[int]]
Steps = PyGenerator["StepEvent", None, "GenerationResult"]


@dataclass
class GenerationResult:
    """Per-prompt lists (in prompt order) and timings of the whole request."""

    tokens: list[list[int]]  # generated ids only, including the EOS / stop token that ended a row
    text: list[str] | None  # decoded generated text; None when the prompts were token ids
    prompt_tokens: list[int]
    finish_reason: list[str]  # "eos" | "stop" | "length"
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


@dataclass
class StepEvent:
    """One token per row. Step 0 is the token sampled from the prefill logits."""

    step: int
    token_ids: list[int | None]  # None for rows that had already finished
    text: list[str] | None  # stable text delta per row ("" when held back); None for token-id prompts
    finished: list[bool]


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


class Generator:
    """Runs an export folder (`kvforge export` output) on a backend (runtime/backend.py)."""

    def __init__(
        self,
        export_dir: str | Path,
        backend: str | Backend | None = None,
        *,
        verify_hashes: bool = False,
        **backend_options: Any,
    ) -> None:
        """`backend`: a name ("ort-cpu", "ort-cuda", "emulate", "trt"), a Backend object, or None for
        the export's default (ort-cpu; emulate for a trt export). `backend_options` go to the backend
        (ONNX Runtime: threads, sessions, device_id, max_capacity; TensorRT: engine_dir, device_id,
        cuda_graphs); an option the backend does not have is an error. `verify_hashes` re-hashes
        every file, weights included, before loading."""
        self.folder = Path(export_dir)
        self.manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        model = self.manifest["model"]
        self.vocab_size = int(model["vocab_size"])
        self.pad_token_id = int(model.get("pad_token_id") if model.get("pad_token_id") is not None else 0)
        generation = self.manifest.get("generation") or {}
        self.eos_token_ids = frozenset(_as_id_list(model.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id")))
        self.default_sampling = SamplingConfig.from_generation(generation)
        self.tokenizer = Tokenizer(self.folder) if (self.folder / TOKENIZER_FILE).is_file() else None
        if backend is None or isinstance(backend, str):
            name = backend or default_backend(self.manifest)
            self.backend: Backend = create_backend(name, self.folder, self.manifest, **backend_options)
        else:
            if backend_options:
                raise InputError("backend options go to create_backend() when passing a Backend object")
            self.backend = backend
        self.backend_name = self.backend.name
        self.max_capacity = self.backend.limits.max_capacity
        # Thread safety: the backend's sessions / engines are shared, each request runs on its own
        # slot (KV cache + bindings) taken from this pool and given back when it ends, so requests
        # from several threads, or several open streams, never share a cache. Idle slots are kept
        # for reuse; capacities come in buckets, so requests of different lengths share slots.
        self.max_idle_slots = 4
        self._idle: list[Slot] = []
        self._pool_lock = threading.Lock()
        self._last_slot: Slot | None = None

    # -- public API -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompts,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        greedy: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        capacity: int | None = None,
        ignore_eos: bool = False,
        keep_logits: bool = False,
        speculate: str | None = None,
        draft_len: int = DEFAULT_DRAFT_LEN,
    ) -> GenerationResult:
        """Generate for one prompt or a batch. Sampling keywords override the manifest's defaults;
        giving temperature/top_k/top_p without `greedy` means sampling. `ignore_eos` runs to
        max_new_tokens (stop_token_ids still stop); `keep_logits` fills `result.logits` (parity).
        `speculate="prompt-lookup"` drafts up to `draft_len` tokens per step from n-gram matches in
        the row's own context and verifies them in one prefill call (greedy only; same tokens as
        plain greedy decoding, fewer graph runs when the output repeats its context)."""
        events = self._run(prompts, max_new_tokens, sampling, greedy, temperature, top_k, top_p, seed,
                           stop_token_ids, capacity, ignore_eos, keep_logits, stream_text=False,
                           speculate=speculate, draft_len=draft_len)
        stream = GenerationStream(events)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompts: Prompts,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        greedy: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        capacity: int | None = None,
        ignore_eos: bool = False,
        keep_logits: bool = False,
        speculate: str | None = None,
        draft_len: int = DEFAULT_DRAFT_LEN,
    ) -> GenerationStream:
        """Like generate(), one StepEvent per step; `.result` afterwards. Inputs are checked here,
        before the first event, so errors surface at the call."""
        events = self._run(prompts, max_new_tokens, sampling, greedy, temperature, top_k, top_p, seed,
                           stop_token_ids, capacity, ignore_eos, keep_logits, stream_text=True,
                           speculate=speculate, draft_len=draft_len)
        return GenerationStream(events)

    @property
    def cache(self) -> CacheState | None:
        """The KV cache of the most recently started request (tests, debugging)."""
        return self._last_slot.cache if self._last_slot is not None else None

    def kv_buffer_addresses(self) -> dict[str, int]:
        """Address of every KV buffer of the most recent request's cache, by graph input name
        ({} before any request)."""
        return self.backend.kv_addresses(self._last_slot) if self._last_slot is not None else {}

    def bound_output_addresses(self, phase: str) -> dict[str, int]:
        """Addresses the last `phase` run of the most recent request wrote its outputs to (KV outputs
        must equal the cache's)."""
        if self._last_slot is None:
            return {}
        return self.backend.bound_output_addresses(self._last_slot, phase)

    @property
    def runs(self) -> dict[str, int]:
        """How many times each graph has run (prefill / decode) since load."""
        return dict(self.backend.runs)

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the export's chat template, as transformers'
        apply_chat_template(..., tokenize=True) gives them. `messages`: [{"role", "content"}, ...] or
        one user message as a str."""
        from kvforge.runtime.chat import check_messages, load_chat_template, render

        if self.tokenizer is None:
            raise InputError(f"{self.folder} has no {TOKENIZER_FILE}, so it cannot chat; pass token ids")
        template, specials = load_chat_template(self.folder, self.manifest)
        if template is None:
            raise InputError(f"{self.folder} has no chat template (the model's tokenizer came without one); "
                             "use a plain prompt instead")
        text = render(template, check_messages(messages), specials, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: Any, *, stream: bool = False, **options: Any) -> GenerationResult | GenerationStream:
        """Answer a conversation: the chat template renders `messages`, the model generates the
        assistant's turn (stopping at the model's end-of-turn token). `options` are generate()'s;
        `stream=True` returns a GenerationStream of text deltas."""
        prompt = RenderedChat(self.chat_ids(messages))
        return self.stream(prompt, **options) if stream else self.generate(prompt, **options)

    def score(self, ids: list[int]) -> np.ndarray:
        """Log-probabilities (natural log) the model gives each token of `ids` after the ones before
        it: [len(ids) - 1] float64, from one prefill call that returns the logits of every position
        (like a Hugging Face forward over the whole window, so position-dependent choices such as
        LongRoPE's short/long factors are made the same way). For perplexity: exp(-mean)."""
        rows, _ = self._prompt_ids([list(ids)])
        ids = rows[0]
        if len(ids) < 2:
            raise InputError("score() needs at least two tokens")
        slot = self._acquire(1, choose_capacity(len(ids), self.max_capacity, None,
                                                buckets=self.backend.limits.capacity_buckets))
        try:
            slot.cache.reset()
            positions = np.arange(len(ids) - 1, dtype=np.int64)[None]
            logits = self._checked(self.backend.prefill(slot, np.array([ids], np.int64), positions), 0)
            logits = logits[0].astype(np.float64)
            peak = logits.max(axis=-1, keepdims=True)
            log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
            return logits[np.arange(len(ids) - 1), ids[1:]] - log_norm
        finally:
            self._release(slot)

    def read_kv_cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of layer `layer`'s key and value buffers [B, H_kv, C, D] (tests, debugging)."""
        if self._last_slot is None:
            raise RuntimeError("no KV cache yet: run generate() first")
        return self.backend.read_kv(self._last_slot, layer)

    # -- internals ------------------------------------------------------------------------------
    def _run(
        self,
        prompts: Prompts,
        max_new_tokens: int,
        sampling: SamplingConfig | None,
        greedy: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop_token_ids: list[int] | None,
        capacity: int | None,
        ignore_eos: bool,
        keep_logits: bool,
        stream_text: bool,
        speculate: str | None = None,
        draft_len: int = DEFAULT_DRAFT_LEN,
    ) -> Steps:
        # Validation happens eagerly (not inside the generator body) so that stream() raises at the call.
        start = time.perf_counter()
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        config = self._sampling_config(sampling, greedy, temperature, top_k, top_p, seed)
        try:
            check_speculation(speculate, draft_len)
        except ValueError as err:
            raise InputError(str(err)) from err
        if speculate is not None:
            if not config.greedy:
                raise InputError("speculative decoding keeps greedy output unchanged and needs greedy decoding; "
                                 "drop temperature/top_k/top_p or pass greedy=True")
            if keep_logits:
                raise InputError("keep_logits is not available with speculative decoding (a step yields several tokens)")
        stop_ids = frozenset(_as_id_list(stop_token_ids, what="stop_token_ids"))
        ids, text_mode = self._prompt_ids(prompts)
        lens = [len(row) for row in ids]
        needed = needed_positions(lens, int(max_new_tokens))
        limits = self.backend.limits
        if limits.max_batch is not None and len(ids) > limits.max_batch:
            raise CapacityError(
                f"{len(ids)} prompts, but backend {self.backend_name!r} runs at most {limits.max_batch} rows "
                "at once (rebuild the engines with a larger --max-batch, or send fewer prompts per call)"
            )
        if speculate is not None:
            # Verification writes draft_len + 1 positions; rows that finished still take part, frozen.
            needed += int(draft_len) + 1
        if speculate is not None and limits.continue_batch is not None and len(ids) > limits.continue_batch:
            raise InputError(
                f"speculative decoding of {len(ids)} prompts at once is not possible on this export: its "
                f"{self.manifest['target']!r} target verifies drafts for at most {limits.continue_batch} row(s) per "
                "call (ONNX Runtime's GroupQueryAttention); send the prompts one by one or export with --target onnx"
            )
        cap = choose_capacity(needed, self.max_capacity, capacity, buckets=limits.capacity_buckets)
        slot = self._acquire(len(ids), cap)
        eos_ids = frozenset() if ignore_eos else self.eos_token_ids
        loop = self._loop(ids, int(max_new_tokens), Sampler(config), eos_ids, stop_ids, slot,
                          text_mode, stream_text, keep_logits, start, int(draft_len) if speculate else 0)
        return self._owning(slot, loop)

    def _owning(self, slot: Slot, loop: Steps) -> Steps:
        """Run `loop` and give its slot back to the pool when it ends, fails or is closed."""
        try:
            return (yield from loop)
        finally:
            self._release(slot)

    def _loop(
        self,
        ids: list[list[int]],
        max_new_tokens: int,
        sampler: Sampler,
        eos_ids: frozenset[int],
        stop_ids: frozenset[int],
        slot: Slot,
        text_mode: bool,
        stream_text: bool,
        keep_logits: bool,
        start: float,
        draft_len: int = 0,
    ) -> Steps:
        batch = len(ids)
        lens = np.array([len(row) for row in ids], dtype=np.int64)
        input_ids = np.full((batch, int(lens.max())), self.pad_token_id, dtype=np.int64)
        for b, row in enumerate(ids):
            input_ids[b, : len(row)] = row

        detoks: list[IncrementalDetokenizer] | None = None
        if text_mode and stream_text:
            assert self.tokenizer is not None
            detoks = [self.tokenizer.incremental() for _ in range(batch)]
        tokens: list[list[int]] = [[] for _ in range(batch)]
        reasons: list[str | None] = [None] * batch
        running = np.ones(batch, dtype=bool)
        kept_logits: list[np.ndarray] = []

        def accept(step: int, picked: np.ndarray, rows: Any = None) -> StepEvent:
            new: list[int | None] = [None] * batch
            deltas = [""] * batch if detoks is not None else None
            for b in np.flatnonzero(running) if rows is None else rows:
                token = int(picked[b])
                tokens[b].append(token)
                new[b] = token
                if token in eos_ids:
                    reasons[b] = "eos"
                elif token in stop_ids:
                    reasons[b] = "stop"
                elif len(tokens[b]) >= max_new_tokens:
                    reasons[b] = "length"
                if reasons[b] is not None:
                    running[b] = False
                if deltas is not None and detoks is not None:
                    deltas[b] = detoks[b].add(token) + (detoks[b].flush() if reasons[b] else "")
            return StepEvent(step=step, token_ids=new, text=deltas, finished=[r is not None for r in reasons])

        cache = slot.cache
        cache.reset()
        t_prefill = time.perf_counter()
        logits = self._checked(self.backend.prefill(slot, input_ids, lens - 1), 0)
        cache.past_lens[:] = lens
        prefill_ms = (time.perf_counter() - t_prefill) * 1e3
        if keep_logits:
            kept_logits.append(logits.copy())  # the backend reuses its logits buffer every run
        event = accept(0, sampler(logits))
        ttft_ms = (time.perf_counter() - start) * 1e3
        yield event

        steps = 0
        decode_s = 0.0
        decoded_tokens = 0
        drafted = accepted_drafts = 0
        feed = np.zeros(batch, dtype=np.int64)
        while running.any():
            t_step = time.perf_counter()
            drafts = self._drafts(ids, tokens, running, draft_len, max_new_tokens) if draft_len else None
            if drafts is not None:
                # One prefill call checks every row's draft: fed [last token, draft...] at past_lens,
                # logits at each fed position. Greedy keeps the draft's matching prefix plus the
                # token after it; positions written beyond that are never read before rewritten.
                width = 1 + max(len(d) for d in drafts)
                block = np.full((batch, width), self.pad_token_id, dtype=np.int64)
                live = np.flatnonzero(running)
                for b in live:
                    block[b, 0] = tokens[b][-1]
                    block[b, 1: 1 + len(drafts[b])] = drafts[b]
                index = np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width))
                picked = greedy_tokens(self._checked(self.backend.prefill(slot, block, index), steps + 1))
                steps += 1
                kept = np.zeros(batch, dtype=np.int64)
                for b in live:
                    draft = drafts[b]
                    n = 0
                    while n < len(draft) and picked[b, n] == draft[n]:
                        n += 1
                    kept[b] = n + 1
                    drafted += len(draft)
                    accepted_drafts += n
                cache.past_lens[live] += kept[live]
                events = []
                for j in range(int(kept.max())):
                    rows = [b for b in live if running[b] and j < kept[b]]
                    if rows:
                        events.append(accept(steps, picked[:, j], rows))
                        decoded_tokens += len(rows)
                decode_s += time.perf_counter() - t_step
                yield from events
                continue
            # Finished rows get the pad token at a frozen past_lens: written, never read.
            feed[:] = self.pad_token_id
            for b in np.flatnonzero(running):
                feed[b] = tokens[b][-1]
            logits = self._checked(self.backend.decode(slot, feed, running), steps + 1)
            cache.past_lens[running] += 1
            steps += 1
            decoded_tokens += int(running.sum())
            if keep_logits:
                kept_logits.append(logits.copy())
            event = accept(steps, sampler(logits))
            decode_s += time.perf_counter() - t_step
            yield event

        text = None
        if text_mode:
            assert self.tokenizer is not None
            text = [self.tokenizer.decode(row) for row in tokens]
        return GenerationResult(
            tokens=tokens,
            text=text,
            prompt_tokens=[int(n) for n in lens],
            finish_reason=[str(r) for r in reasons],
            ttft_ms=ttft_ms,
            prefill_ms=prefill_ms,
            decode_ms=decode_s * 1e3,
            decode_tokens_per_s=decoded_tokens / decode_s if decode_s > 0 else 0.0,
            steps=steps,
            draft_tokens=drafted,
            accepted_tokens=accepted_drafts,
            logits=kept_logits if keep_logits else None,
        )

    @staticmethod
    def _drafts(
        ids: list[list[int]], tokens: list[list[int]], running: np.ndarray, draft_len: int, max_new_tokens: int
    ) -> list[np.ndarray] | None:
        """Each running row's prompt-lookup draft (empty for the others), or None when no row has one.
        A draft never runs past max_new_tokens: the token after it is always produced too."""
        drafts: list[np.ndarray] = []
        for b in range(len(ids)):
            room = min(draft_len, max_new_tokens - len(tokens[b]) - 1)
            if not running[b] or room < 1:
                drafts.append(np.empty(0, dtype=np.int64))
                continue
            context = np.fromiter((*ids[b], *tokens[b]), dtype=np.int64, count=len(ids[b]) + len(tokens[b]))
            drafts.append(prompt_lookup(context, room))
        return drafts if any(len(d) for d in drafts) else None

    def _sampling_config(
        self,
        sampling: SamplingConfig | None,
        greedy: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
    ) -> SamplingConfig:
        overrides = {"greedy": greedy, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        given = {key: value for key, value in overrides.items() if value is not None}
        if sampling is not None:
            if not isinstance(sampling, SamplingConfig):
                raise InputError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
            if given:
                raise InputError(
                    f"pass either sampling=SamplingConfig(...) or the keywords {sorted(given)}, not both"
                )
            return sampling
        if greedy is None and any(key in given for key in ("temperature", "top_k", "top_p")):
            given["greedy"] = False  # asking for a temperature or a filter means asking to sample
        return self.default_sampling.with_overrides(**given)

    def _prompt_ids(self, prompts: Prompts) -> tuple[list[list[int]], bool]:
        """Token id rows for the prompts, and whether they came as text."""
        if isinstance(prompts, RenderedChat):
            return [list(prompts.ids)], True
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
        if isinstance(prompts, (bytes, bytearray)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InputError("no prompts given: pass a str, a list of str, or a list of token-id lists")
        for i, p in enumerate(prompts):
            if isinstance(p, (bytes, bytearray)):
                raise InputError(f"prompt {i} is bytes; pass text as str (decode it from UTF-8 first)")
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise InputError(f"{self.folder} has no {TOKENIZER_FILE}, so prompts must be token ids, not text")
            rows = []
            for i, text in enumerate(prompts):
                if text == "":
                    raise InputError(f"prompt {i} is empty; give at least one character")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as err:  # lone surrogates: bytes that were not UTF-8
                    raise InputError(
                        f"prompt {i} is not valid UTF-8 text (undecodable bytes at character {err.start}); "
                        "pass UTF-8 text"
                    ) from err
                rows.append(self.tokenizer.encode(text))
            text_mode = True
        elif all(_is_int(p) for p in prompts):
            rows = [list(prompts)]  # a single prompt given as one list of ids
            text_mode = False
        elif all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
            rows = [list(p.tolist() if isinstance(p, np.ndarray) else p) for p in prompts]
            text_mode = False
        else:
            raise InputError("prompts must be all text (str) or all token-id lists, not a mix")
        for i, row in enumerate(rows):
            if len(row) == 0:
                raise InputError(f"prompt {i} has no tokens; give at least one token id")
            for pos, token in enumerate(row):
                if not _is_int(token):
                    raise InputError(f"prompt {i} position {pos} holds {token!r}, not an integer token id")
                if not 0 <= int(token) < self.vocab_size:
                    raise InputError(
                        f"prompt {i} position {pos} has token id {int(token)}, outside the vocabulary "
                        f"[0, {self.vocab_size})"
                    )
        return [[int(t) for t in row] for row in rows], text_mode

    def _acquire(self, batch: int, capacity: int) -> Slot:
        """An idle slot of this shape from the pool (its buffers and bindings are reused), or a new one."""
        with self._pool_lock:
            for i in range(len(self._idle) - 1, -1, -1):
                slot = self._idle[i]
                if slot.cache.batch == batch and slot.cache.capacity == capacity:
                    del self._idle[i]
                    self._last_slot = slot
                    return slot
        slot = self.backend.allocate(batch, capacity)
        with self._pool_lock:
            self._last_slot = slot
        return slot

    def _release(self, slot: Slot) -> None:
        with self._pool_lock:
            self._idle.append(slot)
            del self._idle[: max(0, len(self._idle) - self.max_idle_slots)]

    def _checked(self, logits: np.ndarray, step: int) -> np.ndarray:
        # NaN logits mean garbage tokens; say so instead of sampling token 0 forever.
        if np.isnan(logits).any():
            raise NumericalError(
                f"the model produced NaN logits at step {step}; the export may be corrupted: check it with "
                f"`kvforge inspect {self.folder} --verify` (or an fp16 export overflowed: try --dtype fp32)",
                step=step,
            )
        return logits


class RenderedChat:
    """A conversation already rendered to token ids: generated as text (decoded, streamed)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _as_id_list(value: Any, what: str = "token id") -> list[int]:
    """None, one id, or a list of ids -> list of ids."""
    if value is None:
        return []
    values = [value] if _is_int(value) else value
    if not isinstance(values, (list, tuple, set, frozenset)) or not all(_is_int(v) for v in values):
        raise InputError(f"{what} must be an integer or a list of integers, got {value!r}")
    return [int(v) for v in values]
