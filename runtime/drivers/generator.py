"""Generator: runs an export folder on a backend, one request at a time per slot (any number of
threads or open streams at once).

    gen = Generator(folder)
    gen.generate(["Once upon a time"], max_new_tokens=16, greedy=True)   # keywords: GenerationRequest.create's
    gen.generate(GenerationRequest.create(...))                           # or a request built beforehand
    gen.stream(...), gen.chat(messages, ...), gen.chat_stream(messages, ...), gen.score(ids)
    gen.prompt_logprobs(ids, top=5)                                       # score() with top-k, per token

The pieces: runtime/controls/request.py (the request, finish reasons, stop handling), runtime/text/prompts.py
(prompt forms and their checks), runtime/drivers/slot_pool.py (KV-cache slots per request),
runtime/drivers/decode_loop.py (the step loop, speculation, the result types).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import CapacityError, InputError
from kvforge.runtime.backends.backend import Backend, Slot
from kvforge.runtime.backends.kv_cache import CacheState, choose_capacity, needed_positions
from kvforge.runtime.controls.logprobs import MAX_LOGPROBS, TokenLogprob, token_logprobs
from kvforge.runtime.controls.request import GenerationRequest, Speculation, Stopper
from kvforge.runtime.controls.sampling import choice_seed
from kvforge.runtime.controls.speculate import HEAD_METHODS
from kvforge.runtime.drivers.decode_loop import (
    GenerationResult,
    GenerationStream,
    StepEvent,
    Steps,
    run_steps,
)
from kvforge.runtime.drivers.draft_model import DraftModel
from kvforge.runtime.drivers.engine import StepEngine
from kvforge.runtime.drivers.loaded_export import LoadedExport
from kvforge.runtime.drivers.proposers import PROMPT_LOOKUP, Proposer
from kvforge.runtime.drivers.rows import Picker, Row
from kvforge.runtime.drivers.slot_pool import SlotPool
from kvforge.runtime.text.prompts import Prompts, RenderedChat, is_int, parse_prompts

# Re-exported: these lived here before the split.
__all__ = ["GenerationRequest", "GenerationResult", "GenerationStream", "Generator", "Prompts", "RenderedChat",
           "StepEvent"]


class Generator:
    """Runs a loaded export (runtime/drivers/loaded_export.py) one request at a time per slot; the export's attributes
    and helpers (folder, manifest, tokenizer, backend, request(), chat_ids(), ...) read through it."""

    def __init__(
        self,
        export: str | Path | LoadedExport,
        backend: str | Backend | None = None,
        *,
        verify_hashes: bool = False,
        draft: str | Path | LoadedExport | None = None,
        **backend_options: Any,
    ) -> None:
        """`export`: a LoadedExport, or an export folder loaded here with LoadedExport's arguments (`backend`: a
        name, a Backend object or None for the export's default; `backend_options` go to the backend;
        `verify_hashes` re-hashes every file, weights included, before loading). `draft`: an export with the
        target's vocabulary that drafts for `speculate="draft"` (runtime/drivers/draft_model.py); with one, an
        export loaded here on ONNX Runtime does not spin (speculation_checks.target_options) unless `spinning` is
        given."""
        if isinstance(export, LoadedExport):
            if backend is not None or backend_options or verify_hashes:
                raise InputError("a LoadedExport already has its backend: pass no backend options with it")
            self.export = export
        else:
            if draft is not None:
                from kvforge.runtime.drivers.speculation_checks import target_options

                backend_options = target_options(export, backend, "draft", backend_options)
            self.export = LoadedExport(export, backend, verify_hashes=verify_hashes, **backend_options)
        # Thread safety: the backend's sessions / engines are shared, each request runs on its own
        # slot (KV cache + bindings) from this pool (runtime/drivers/slot_pool.py).
        self.slots = SlotPool(self.export.backend)
        self.draft = DraftModel.open(draft, self.export) if draft is not None else None
        self._head: Any = None  # the export's speculation head (runtime/backends/head_runner.py), once asked for

    def __getattr__(self, name: str) -> Any:
        """The loaded export's attributes and helpers (folder, manifest, tokenizer, backend, request, chat_ids, ...)."""
        if name == "export":  # not set yet: never look for it in itself
            raise AttributeError(name)
        return getattr(self.export, name)

    # -- requests -------------------------------------------------------------------------------
    def generate(self, prompts: Prompts | GenerationRequest, *args: Any, **options: Any) -> GenerationResult:
        """Generate for one prompt or a batch: a GenerationRequest, or prompts and the options of
        `request()`. `ignore_eos` runs to max_new_tokens (stop tokens and strings still stop);
        `keep_logits` fills `result.logits` (parity). `speculate` drafts up to `draft_len` tokens per
        step and verifies them in one prefill call: "prompt-lookup" from n-gram matches in the row's own
        context, "draft" with the Generator's draft export, "eagle" / "mtp" with the export's head
        (greedy: the tokens of plain greedy decoding; sampling: the target's distribution). `n` > 1 repeats each prompt row n times in the batch
        (result rows prompt-major); `logprobs=k` fills `result.logprobs`."""
        stream = GenerationStream(self._run(self.request(prompts, *args, **options), stream_text=False))
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompts: Prompts | GenerationRequest, *args: Any, **options: Any) -> GenerationStream:
        """Like generate(), one StepEvent per step; `.result` afterwards. Inputs are checked here,
        before the first event, so errors surface at the call."""
        return GenerationStream(self._run(self.request(prompts, *args, **options), stream_text=True))

    def chat_request(self, messages: Any, **options: Any) -> GenerationRequest:
        """The request answering a conversation: `messages` rendered with the chat template (see
        chat_ids), generated as text; `options` are request()'s."""
        if "stream" in options:
            raise InputError("chat() returns a GenerationResult; use chat_stream() for a GenerationStream")
        ids, images = self.chat_inputs(messages)
        if images:
            if options.get("images") is not None:
                raise InputError("give a conversation's images as image parts of its messages, not also as images=")
            options["images"] = images
        return self.request(RenderedChat(ids), **options)

    def chat(self, messages: Any, **options: Any) -> GenerationResult:
        """Answer a conversation: the chat template renders `messages`, the model generates the
        assistant's turn (stopping at the model's end-of-turn token). `options` are request()'s."""
        return self.generate(self.chat_request(messages, **options))

    def chat_stream(self, messages: Any, **options: Any) -> GenerationStream:
        """chat() as a GenerationStream of text deltas."""
        return self.stream(self.chat_request(messages, **options))

    def score(self, ids: list[int]) -> np.ndarray:
        """Log-probabilities (natural log) the model gives each token of `ids` after the ones before
        it: [len(ids) - 1] float64, from one prefill call that returns the logits of every position
        (like a Hugging Face forward over the whole window, so position-dependent choices such as
        LongRoPE's short/long factors are made the same way). For perplexity: exp(-mean)."""
        ids, logits = self._prompt_logits(ids, "score()")
        logits = logits.astype(np.float64)
        peak = logits.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
        return logits[np.arange(len(ids) - 1), ids[1:]] - log_norm

    def prompt_logprobs(self, ids: list[int], top: int = 0) -> list[TokenLogprob | None]:
        """score() with the `top` most likely tokens of every position (0..20): one TokenLogprob per
        token of `ids`, None for the first (nothing predicts it), as OpenAI's echo returns them. The
        values are score()'s (log_softmax of the same one-prefill logits)."""
        if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise InputError(f"top must be an integer in 0..{MAX_LOGPROBS}, got {top!r}")
        if len(ids) == 1:
            parse_prompts([list(ids)], self.tokenizer, self.vocab_size, self.folder)  # checks the id
            return [None]
        ids, logits = self._prompt_logits(ids, "prompt_logprobs()")
        scored = token_logprobs(logits, np.asarray(ids[1:]), int(top), range(len(ids) - 1))
        return [None, *(scored[i] for i in range(len(ids) - 1))]

    def _prompt_logits(self, ids: list[int], what: str) -> tuple[list[int], np.ndarray]:
        """The checked ids and the logits [len(ids) - 1, V] predicting ids[1:], from one prefill."""
        rows, _ = parse_prompts([list(ids)], self.tokenizer, self.vocab_size, self.folder)
        ids = rows[0]
        if len(ids) < 2:
            raise InputError(f"{what} needs at least two tokens")
        slot = self.slots.acquire(1, choose_capacity(len(ids), self.max_capacity, None,
                                                     buckets=self.backend.limits.capacity_buckets))
        try:
            slot.cache.reset()
            positions = np.arange(len(ids) - 1, dtype=np.int64)[None]
            logits = self.check_logits(self.backend.prefill(slot, np.array([ids], np.int64), positions), 0)
            return ids, np.array(logits[0])  # a copy: the backend reuses its logits buffer
        finally:
            self.slots.release(slot)

    # -- state (tests, debugging) ---------------------------------------------------------------
    @property
    def max_idle_slots(self) -> int:
        """Idle slots kept for reuse."""
        return self.slots.max_idle

    @max_idle_slots.setter
    def max_idle_slots(self, value: int) -> None:
        self.slots.max_idle = value

    @property
    def cache(self) -> CacheState | None:
        """The KV cache of the most recently started request."""
        return self.slots.last.cache if self.slots.last is not None else None

    @property
    def runs(self) -> dict[str, int]:
        """How many times each graph has run (prefill / decode) since load."""
        return dict(self.backend.runs)

    # -- internals ------------------------------------------------------------------------------
    def _run(self, request: GenerationRequest, stream_text: bool) -> Steps:
        # Checked and given a slot eagerly (not inside the generator body) so that stream() raises at the call.
        start = time.perf_counter()
        if request.speculation is not None and request.speculation.off:  # a Scheduler's opt-out: nothing here
            request = request.replace(speculation=None)
        ids, text_mode, images = self.prompt_inputs(request)
        ids = [row for row in ids for _ in range(request.n)]  # n choices: each prompt row n times, prompt-major
        images = [row for row in images for _ in range(request.n)] if images is not None else None
        needed = needed_positions([len(row) for row in ids], request.max_new_tokens)
        limits = self.backend.limits
        if limits.max_batch is not None and len(ids) > limits.max_batch:
            raise CapacityError(
                f"{len(ids)} prompts, but backend {self.backend_name!r} runs at most {limits.max_batch} rows "
                "at once (rebuild the engines with a larger --max-batch, or send fewer prompts per call)"
            )
        limits.check_speculation(request.speculation)
        proposer = self._proposer(request.speculation)
        if request.speculation is not None:
            # Verification writes draft_len + 1 positions; rows that finished still take part, frozen.
            needed += request.speculation.draft_len + 1
            if self._continue_batch(request.speculation) is not None \
                    and len(ids) > self._continue_batch(request.speculation):
                raise InputError(
                    f"speculative decoding of {len(ids)} prompts at once is not possible on this export: its "
                    f"{self.manifest['target']!r} target verifies drafts for at most {limits.continue_batch} "
                    "row(s) per call (ONNX Runtime's GroupQueryAttention); send the prompts one by one or export "
                    "with --target onnx"
                )
        cap = choose_capacity(needed, self.max_capacity, request.capacity, buckets=limits.capacity_buckets)
        # Text is decoded step by step only where it is streamed or stop strings must be found in it.
        incremental = self.tokenizer is not None and ((text_mode and stream_text) or bool(request.stop))
        rows = [Row(prompt, Stopper(request, self.eos_token_ids, self.tokenizer.incremental() if incremental else None),
                    self.row_controls(request, prompt), keep_logprobs=request.logprobs is not None)
                for prompt in ids]  # a grammar that fails, fails here, before a slot is taken
        for row, row_images in zip(rows, images or (), strict=False):
            if row_images is not None:
                row_images.attach(row)
        # n choices: each its own stream, as its own Scheduler choice draws (seed + i); else one for the batch.
        n = request.n
        picker = Picker(request.sampling, [choice_seed(request.sampling.seed, b % n) for b in range(len(ids))]
                        if n > 1 else None, logprobs=request.logprobs)
        slot = self.slots.acquire(len(ids), cap)
        engine = StepEngine(self.backend, slot, self.pad_token_id, self.check_logits)
        for b, row in enumerate(rows):
            engine.place(b, row, picker, proposer)
        steps = run_steps(engine, request, ids, self.tokenizer, text_mode, text_mode and stream_text, start)
        return self._owning(slot, steps)

    def _proposer(self, speculation: Speculation | None) -> Proposer | None:
        """A request's proposer (one per request: a model's proposer holds its rows)."""
        if speculation is None:
            return None
        if speculation.method == "draft":
            if self.draft is None:
                raise InputError("speculate='draft' needs a draft export: Generator(export, draft=DIR), or "
                                 "--draft DIR on the command line")
            return self.draft.proposer()
        if speculation.method in HEAD_METHODS:
            from kvforge.runtime.drivers.head_proposer import HeadProposer, check_head, export_head

            check_head(self.manifest, speculation.method, f"speculate={speculation.method!r}")
            if self._head is None:
                self._head = export_head(self.export, speculation.method)  # opened once, run by each request's proposer
            return HeadProposer(self._head)
        return PROMPT_LOOKUP

    def _continue_batch(self, speculation: Speculation) -> int | None:
        """Most rows a verification (and a draft export's catch-up) extends at once."""
        limits = [self.backend.limits.continue_batch]
        if speculation.method == "draft" and self.draft is not None:
            limits.append(self.draft.export.backend.limits.continue_batch)
        known = [limit for limit in limits if limit is not None]
        return min(known) if known else None

    def _owning(self, slot: Slot, loop: Steps) -> Steps:
        """Run `loop` and give its slot back to the pool when it ends, fails or is closed."""
        try:
            return (yield from loop)
        finally:
            self.slots.release(slot)
