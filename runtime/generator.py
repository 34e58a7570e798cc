"""Generator: runs an export folder on a backend, one request at a time per slot (any number of
threads or open streams at once).

    gen = Generator(folder)
    gen.generate(["Once upon a time"], max_new_tokens=16, greedy=True)   # keywords: GenerationRequest.create's
    gen.generate(GenerationRequest.create(...))                           # or a request built beforehand
    gen.stream(...), gen.chat(messages, ...), gen.chat_stream(messages, ...), gen.score(ids)
    gen.prompt_logprobs(ids, top=5)                                       # score() with top-k, per token

The pieces: runtime/request.py (the request, finish reasons, stop handling), runtime/prompts.py
(prompt forms and their checks), runtime/slot_pool.py (KV-cache slots per request),
runtime/decode_loop.py (the step loop, speculation, the result types).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.contract import ModelSpec
from kvforge.core.errors import CapacityError, InputError, KvforgeError, NumericalError
from kvforge.core.manifest import load_manifest
from kvforge.runtime.backend import Backend, Slot, create_backend, default_backend
from kvforge.runtime.chat import ChatTemplate, read_chat_template
from kvforge.runtime.decode_loop import GenerationResult, GenerationStream, StepEvent, Steps, run_steps
from kvforge.runtime.engine import StepEngine
from kvforge.runtime.kv_cache import CacheState, choose_capacity, needed_positions
from kvforge.runtime.logit_controls import RowControls
from kvforge.runtime.logprobs import MAX_LOGPROBS, TokenLogprob, token_logprobs
from kvforge.runtime.prompts import Prompts, RenderedChat, as_id_list, is_int, parse_prompts
from kvforge.runtime.request import GenerationRequest, Stopper
from kvforge.runtime.rows import Picker, Row
from kvforge.runtime.sampling import SamplingConfig, choice_seed
from kvforge.runtime.slot_pool import SlotPool
from kvforge.runtime.tokenizer import TOKENIZER_FILE, Tokenizer
from kvforge.runtime.vocabulary import Vocabulary

# Re-exported: these lived here before the split.
__all__ = ["GenerationRequest", "GenerationResult", "GenerationStream", "Generator", "Prompts", "RenderedChat",
           "StepEvent"]
# Backends loaded in a thread beside the tokenizer (ONNX Runtime on the CPU; a CUDA or TensorRT
# context belongs to the thread that makes it, so those load on the caller's thread).
THREADED_LOAD = ("ort-cpu",)


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
        """`backend`: a name ("ort-cpu", "ort-cuda", "emulate", "tensorrt"), a Backend object, or None for
        the export's default (ort-cpu; emulate for a trt export). `backend_options` go to the backend
        (ONNX Runtime: threads, sessions, device_id, max_capacity; TensorRT: engine_dir, device_id,
        cuda_graphs); an option the backend does not have is an error. `verify_hashes` re-hashes
        every file, weights included, before loading."""
        self.folder = Path(export_dir)
        self.manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        model = ModelSpec.from_manifest(self.manifest)
        self.vocab_size = model.vocab_size
        # Padding rows only need a real id: -1 (Hugging Face's "none") or none at all pads with 0.
        self.pad_token_id = model.pad_token_id if model.pad_token_id is not None and model.pad_token_id >= 0 else 0
        generation = self.manifest.get("generation") or {}
        self.eos_token_ids = frozenset(as_id_list(list(model.eos_token_id))
                                       + as_id_list(generation.get("eos_token_id")))
        self.default_sampling = SamplingConfig.from_generation(generation)
        if backend is not None and not isinstance(backend, str) and backend_options:
            raise InputError("backend options go to create_backend() when passing a Backend object")
        name = (backend or default_backend(self.manifest)) if backend is None or isinstance(backend, str) else None
        building: Future[Backend] | None = None
        if name in THREADED_LOAD:
            # ONNX Runtime builds a session (graph optimisation, weight prepacking: most of a cold
            # start) with the GIL released, so the tokenizer and chat template load meanwhile.
            with ThreadPoolExecutor(1, thread_name_prefix="kvforge-load") as pool:
                building = pool.submit(create_backend, name, self.folder, self.manifest, **backend_options)
                self._load_text()  # (leaving the block waits for the backend, also on an error here)
        else:
            self._load_text()
        self.vocabulary = Vocabulary(self.folder, self.tokenizer, self.vocab_size, self.pad_token_id,
                                     self.eos_token_ids)
        if building is not None:
            self.backend: Backend = building.result()  # its error, if any, raised here
        elif name is not None:
            self.backend = create_backend(name, self.folder, self.manifest, **backend_options)
        else:
            self.backend = backend
        self.backend_name = self.backend.name
        self.max_capacity = self.backend.limits.max_capacity
        # Thread safety: the backend's sessions / engines are shared, each request runs on its own
        # slot (KV cache + bindings) from this pool (runtime/slot_pool.py).
        self.slots = SlotPool(self.backend)

    def _load_text(self) -> None:
        """The tokenizer and the chat template."""
        self.tokenizer = Tokenizer(self.folder) if (self.folder / TOKENIZER_FILE).is_file() else None
        # The chat template is read and hashed once, here: a file swapped (or linked elsewhere) after
        # the load is never rendered. A broken one fails only the chat calls, with its message.
        self._chat_template: ChatTemplate | None = None
        self._chat_template_error: KvforgeError | None = None
        try:
            self._chat_template = read_chat_template(self.folder, self.manifest)
        except KvforgeError as err:
            self._chat_template_error = err

    # -- requests -------------------------------------------------------------------------------
    def request(self, prompts: Prompts | GenerationRequest, *args: Any, **options: Any) -> GenerationRequest:
        """The GenerationRequest for `prompts` and GenerationRequest.create's options (max_new_tokens,
        sampling or greedy/temperature/top_k/top_p/min_p/seed/presence_penalty/frequency_penalty/
        repetition_penalty, stop_token_ids, stop, capacity, ignore_eos, keep_logits, speculate,
        draft_len, logprobs, n, grammar), the sampling keywords overriding this export's
        generation config. A GenerationRequest is returned as is (no options with it)."""
        if isinstance(prompts, GenerationRequest):
            if args or options:
                raise InputError("pass either a GenerationRequest or prompts with options, not both")
            return prompts
        return GenerationRequest.create(prompts, *args, defaults=self.default_sampling, **options)

    def generate(self, prompts: Prompts | GenerationRequest, *args: Any, **options: Any) -> GenerationResult:
        """Generate for one prompt or a batch: a GenerationRequest, or prompts and the options of
        `request()`. `ignore_eos` runs to max_new_tokens (stop tokens and strings still stop);
        `keep_logits` fills `result.logits` (parity). `speculate="prompt-lookup"` drafts up to
        `draft_len` tokens per step from n-gram matches in the row's own context and verifies them
        in one prefill call (greedy only; same tokens as plain greedy decoding, fewer graph runs
        when the output repeats its context). `n` > 1 repeats each prompt row n times in the batch
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
        return self.request(RenderedChat(self.chat_ids(messages)), **options)

    def chat(self, messages: Any, **options: Any) -> GenerationResult:
        """Answer a conversation: the chat template renders `messages`, the model generates the
        assistant's turn (stopping at the model's end-of-turn token). `options` are request()'s."""
        return self.generate(self.chat_request(messages, **options))

    def chat_stream(self, messages: Any, **options: Any) -> GenerationStream:
        """chat() as a GenerationStream of text deltas."""
        return self.stream(self.chat_request(messages, **options))

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                 special_tokens_in_content: bool = False) -> list[int]:
        """Token ids of a conversation rendered with the export's chat template, as transformers'
        apply_chat_template(..., tokenize=True) gives them, except that special-token text inside a
        message's content ("<|im_end|>" typed by a user) stays text rather than becoming the control
        token (runtime/chat_tokens.py; `special_tokens_in_content=True`: parsed, as transformers does).
        `messages`: [{"role", "content"}, ...] or one user message as a str; `tools`: OpenAI's tool
        list, for templates that take one (kvforge.runtime.tool_calls parses the calls out of the answer)."""
        from kvforge.runtime.chat_tokens import conversation_ids
        from kvforge.runtime.messages import check_messages
        from kvforge.runtime.tool_calls import check_tools, template_takes_tools

        template = self.chat_template
        if tools is not None and not template_takes_tools(template.text):
            raise InputError(f"{template.source} does not support tools (it never reads a `tools` variable)")
        checked_tools = check_tools(tools) if tools is not None else None
        assert self.tokenizer is not None  # checked by chat_template
        return conversation_ids(lambda ms: template.render(ms, add_generation_prompt, checked_tools),
                                check_messages(messages), self.tokenizer,
                                special_tokens_in_content=special_tokens_in_content)

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template read at load, or the InputError/ManifestError saying why there is none."""
        if self.tokenizer is None:
            raise InputError(f"{self.folder} has no {TOKENIZER_FILE}, so it cannot chat; pass token ids")
        if self._chat_template_error is not None:
            raise self._chat_template_error
        if self._chat_template is None:
            raise InputError(f"{self.folder} has no chat template (the model's tokenizer came without one); "
                             "use a plain prompt instead")
        return self._chat_template

    def prompt_ids(self, request: GenerationRequest) -> tuple[list[list[int]], bool]:
        """The request's prompts as token-id rows (checked against the vocabulary), and whether they
        came as text. Stop strings need the tokenizer."""
        if request.stop and self.tokenizer is None:
            raise InputError(f"stop strings need the export's {TOKENIZER_FILE}; {self.folder} has none")
        outside = sorted(t for t in request.stop_token_ids if not 0 <= t < self.vocab_size)
        if outside:  # the model can never emit them: such a stop would never stop anything
            raise InputError(f"stop_token_ids {outside[:8]} are not token ids of this model (0..{self.vocab_size - 1})")
        return parse_prompts(request.prompts, self.tokenizer, self.vocab_size, self.folder)

    def grammar_matcher(self, grammar: Any) -> Any:
        """A fresh per-row matcher for the constraint spec `grammar` (request.grammar): the spec's
        `matcher(vocabulary)` (this export's Vocabulary); the matcher's `apply(logits_row)` masks,
        `advance(token)` moves on (runtime/logit_controls.py)."""
        make = getattr(grammar, "matcher", None)
        if not callable(make):
            raise InputError(f"constrained decoding needs a grammar spec with a matcher(vocabulary) method (see "
                             f"kvforge.runtime.constraint), got {type(grammar).__name__}")
        return make(self.vocabulary)

    def row_controls(self, request: GenerationRequest, prompt: list[int]) -> RowControls | None:
        """The penalties / grammar matcher of one row of `request`, or None when it has neither."""
        if not request.sampling.penalized and request.grammar is None:
            return None
        matcher = self.grammar_matcher(request.grammar) if request.grammar is not None else None
        return RowControls(request.sampling, prompt, matcher)

    def check_logits(self, logits: np.ndarray, step: int, greedy_picks: Sequence[int] | None = None) -> np.ndarray:
        """`logits` unchanged, or NumericalError if any is NaN (garbage tokens otherwise: say so
        instead of sampling token 0 forever). `greedy_picks`: each row's argmax of these very logits;
        argmax picks a row's first NaN, so only the picked logits need a look (a full pass over a cold
        [B, V] buffer costs ~0.1 ms, a few percent of a small model's decode step)."""
        if greedy_picks is not None:
            # Python scalars: cheaper than numpy's fancy indexing for a decode step's few rows.
            bad = False
            for b, pick in enumerate(greedy_picks):
                bad = bad or math.isnan(logits[b, pick])
        else:
            bad = np.isnan(logits).any()
        if bad:
            raise NumericalError(
                f"the model produced NaN logits at step {step}; the export may be corrupted: check it with "
                f"`kvforge inspect {self.folder} --verify` (or an fp16 export overflowed: try --dtype fp32)",
                step=step,
            )
        return logits

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
        ids, text_mode = self.prompt_ids(request)
        ids = [row for row in ids for _ in range(request.n)]  # n choices: each prompt row n times, prompt-major
        needed = needed_positions([len(row) for row in ids], request.max_new_tokens)
        limits = self.backend.limits
        if limits.max_batch is not None and len(ids) > limits.max_batch:
            raise CapacityError(
                f"{len(ids)} prompts, but backend {self.backend_name!r} runs at most {limits.max_batch} rows "
                "at once (rebuild the engines with a larger --max-batch, or send fewer prompts per call)"
            )
        limits.check_speculation(request.speculation)
        if request.speculation is not None:
            # Verification writes draft_len + 1 positions; rows that finished still take part, frozen.
            needed += request.speculation.draft_len + 1
            if limits.continue_batch is not None and len(ids) > limits.continue_batch:
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
        # n choices: each its own stream, as its own Scheduler choice draws (seed + i); else one for the batch.
        n = request.n
        picker = Picker(request.sampling, [choice_seed(request.sampling.seed, b % n) for b in range(len(ids))]
                        if n > 1 else None, logprobs=request.logprobs)
        slot = self.slots.acquire(len(ids), cap)
        engine = StepEngine(self.backend, slot, self.pad_token_id, self.check_logits)
        for b, row in enumerate(rows):
            engine.place(b, row, picker)
        steps = run_steps(engine, request, ids, self.tokenizer, text_mode, text_mode and stream_text, start)
        return self._owning(slot, steps)

    def _owning(self, slot: Slot, loop: Steps) -> Steps:
        """Run `loop` and give its slot back to the pool when it ends, fails or is closed."""
        try:
            return (yield from loop)
        finally:
            self.slots.release(slot)
