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

from kvforge.errors import InputError, NumericalError
from kvforge.manifest import load_manifest
from kvforge.runtime.kv_cache import KVCache, choose_capacity, needed_positions
from kvforge.runtime.ort_backend import OrtBackend, OrtSlot
from kvforge.runtime.sampling import Sampler, SamplingConfig
from kvforge.runtime.tokenizer import TOKENIZER_FILE, IncrementalDetokenizer, Tokenizer

BACKENDS = {"ort-cpu": "cpu", "ort-cuda": "cuda", "emulate": "cpu"}
# Which backends run which export targets: a `trt` export's attention is kvforge's TensorRT plugin.
TARGET_BACKENDS = {"ort": ("ort-cpu", "ort-cuda"), "onnx": ("ort-cpu", "ort-cuda"), "trt": ("emulate",)}

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
    steps: int  # decode graph runs
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
    """Runs an export folder (`kvforge export` output) with ONNX Runtime."""

    def __init__(
        self,
        export_dir: str | Path,
        backend: str | None = None,
        threads: int | None = None,
        verify_hashes: bool = False,
        device_id: int = 0,
        sessions: str = "single",
    ) -> None:
        """`sessions` picks how the two phases share the weights in memory:
        "single" (default): one session of the prefill graph runs prefill and decode steps (S=1);
        one weight copy, prepacked by ORT for its fastest CPU matmuls.
        "shared": prefill.onnx and decode.onnx sessions over one memory-mapped copy, prepacking off.
        "separate": both graphs, each session prepacks its own copy (twice the memory).
        `backend` None picks the export's natural backend: ort-cpu, or emulate for a trt export."""
        if backend is not None and backend not in BACKENDS:
            raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.folder = Path(export_dir)
        self.manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        model = self.manifest["model"]
        self.vocab_size = int(model["vocab_size"])
        self.pad_token_id = int(model.get("pad_token_id") if model.get("pad_token_id") is not None else 0)
        self.max_capacity = int(self.manifest["kv_cache"]["max_capacity"])
        generation = self.manifest.get("generation") or {}
        self.eos_token_ids = frozenset(_as_id_list(model.get("eos_token_id")) + _as_id_list(generation.get("eos_token_id")))
        self.default_sampling = SamplingConfig.from_generation(generation)
        self.tokenizer = Tokenizer(self.folder) if (self.folder / TOKENIZER_FILE).is_file() else None
        target = self.manifest["target"]
        if backend is None:
            backend = TARGET_BACKENDS.get(target, ("ort-cpu",))[0]
        self.backend_name = backend
        if backend not in TARGET_BACKENDS.get(target, ()):
            raise InputError(_wrong_backend(self.folder, target, backend))
        if self.manifest["kv_cache"]["dtype"] == "bfloat16" and backend in ("ort-cpu", "emulate"):
            raise InputError(
                f"{self.folder} is a bf16 export: ONNX Runtime CPU has no bfloat16 kernels, so backend "
                f"{backend!r} cannot run it; build TensorRT engines from it, or export with --dtype fp16 or fp32"
            )
        custom_ops = None
        if backend == "emulate":
            from kvforge.runtime.emulate import custom_ops_library

            if self.manifest["kv_cache"]["dtype"] != "float32":
                raise InputError(
                    f"backend 'emulate' runs fp32 trt exports only ({self.folder} is "
                    f"{self.manifest['dtype']}): its Python op bridge has no float16/bfloat16; export with --dtype fp32"
                )
            custom_ops = custom_ops_library()
        self.backend = OrtBackend(
            self.folder, self.manifest, device=BACKENDS[backend], device_id=device_id, threads=threads,
            sessions=sessions, custom_ops_library=custom_ops,
        )
        # Thread safety: the sessions are shared, each request runs on its own slot (KV cache + IO
        # bindings) taken from this pool and given back when it ends, so requests from several
        # threads, or several open streams, never share a cache. Idle slots are kept for reuse.
        self.max_idle_slots = 4
        self._idle: list[OrtSlot] = []
        self._pool_lock = threading.Lock()
        self._last_slot: OrtSlot | None = None

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
    ) -> GenerationResult:
        """Generate for one prompt or a batch. Sampling keywords override the manifest's defaults;
        giving temperature/top_k/top_p without `greedy` means sampling. `ignore_eos` runs to
        max_new_tokens (stop_token_ids still stop); `keep_logits` fills `result.logits` (parity)."""
        events = self._run(prompts, max_new_tokens, sampling, greedy, temperature, top_k, top_p, seed,
                           stop_token_ids, capacity, ignore_eos, keep_logits, stream_text=False)
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
    ) -> GenerationStream:
        """Like generate(), one StepEvent per step; `.result` afterwards. Inputs are checked here,
        before the first event, so errors surface at the call."""
        events = self._run(prompts, max_new_tokens, sampling, greedy, temperature, top_k, top_p, seed,
                           stop_token_ids, capacity, ignore_eos, keep_logits, stream_text=True)
        return GenerationStream(events)

    @property
    def cache(self) -> KVCache | None:
        """The KV cache of the most recently started request (tests, debugging)."""
        return self._last_slot.cache if self._last_slot is not None else None

    def kv_buffer_addresses(self) -> dict[str, int]:
        """Address of every KV buffer of the most recent request's cache, by graph input name
        ({} before any request)."""
        return self.cache.addresses() if self.cache is not None else {}

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

    def read_kv_cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of layer `layer`'s key and value buffers [B, H_kv, C, D] (tests, debugging)."""
        if self.cache is None:
            raise RuntimeError("no KV cache yet: run generate() first")
        return self.cache.read(layer)

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
    ) -> Steps:
        # Validation happens eagerly (not inside the generator body) so that stream() raises at the call.
        start = time.perf_counter()
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        config = self._sampling_config(sampling, greedy, temperature, top_k, top_p, seed)
        stop_ids = frozenset(_as_id_list(stop_token_ids, what="stop_token_ids"))
        ids, text_mode = self._prompt_ids(prompts)
        lens = [len(row) for row in ids]
        needed = needed_positions(lens, int(max_new_tokens))
        cap = choose_capacity(needed, self.max_capacity, capacity)
        slot = self._acquire(len(ids), cap)
        eos_ids = frozenset() if ignore_eos else self.eos_token_ids
        loop = self._loop(ids, int(max_new_tokens), Sampler(config), eos_ids, stop_ids, slot,
                          text_mode, stream_text, keep_logits, start)
        return self._owning(slot, loop)

    def _owning(self, slot: OrtSlot, loop: Steps) -> Steps:
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
        slot: OrtSlot,
        text_mode: bool,
        stream_text: bool,
        keep_logits: bool,
        start: float,
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

        def accept(step: int, picked: np.ndarray) -> StepEvent:
            new: list[int | None] = [None] * batch
            deltas = [""] * batch if detoks is not None else None
            for b in np.flatnonzero(running):
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
        logits = self._checked(self.backend.run_prefill(slot, input_ids, lens - 1), 0)
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
        feed = np.zeros(batch, dtype=np.int64)
        while running.any():
            t_step = time.perf_counter()
            # Finished rows get the pad token at a frozen past_lens: written, never read.
            feed[:] = self.pad_token_id
            for b in np.flatnonzero(running):
                feed[b] = tokens[b][-1]
            logits = self._checked(self.backend.run_decode(slot, feed, running), steps + 1)
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
            logits=kept_logits if keep_logits else None,
        )
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

    def _acquire(self, batch: int, capacity: int) -> OrtSlot:
        """An idle slot of this shape from the pool (its buffers and bindings are reused), or a new one."""
        with self._pool_lock:
            for i in range(len(self._idle) - 1, -1, -1):
                slot = self._idle[i]
                if slot.cache.batch == batch and slot.cache.capacity == capacity:
                    del self._idle[i]
                    self._last_slot = slot
                    return slot
        cache = KVCache.from_manifest(
            self.manifest, batch, capacity, device=self.backend.device, device_id=self.backend.device_id
        )
        slot = self.backend.bind(cache)
        with self._pool_lock:
            self._last_slot = slot
        return slot

    def _release(self, slot: OrtSlot) -> None:
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


def _wrong_backend(folder: Path, target: str, backend: str) -> str:
    if target == "trt":
        return (f"{folder} is a trt-target export (its attention is kvforge's TensorRT plugin): run it with "
                "backend 'emulate' (CPU emulation), or build TensorRT engines from it")
    if target in TARGET_BACKENDS:
        return (f"backend {backend!r} does not run {target}-target exports like {folder}; "
                f"use one of {', '.join(TARGET_BACKENDS[target])}")
    return f"{folder} has target {target!r}, which this kvforge does not know; re-run the export"


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
