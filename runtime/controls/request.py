"""One generation request, its finish reasons and its stop handling, shared by the Generator
(runtime/drivers/generator.py), the continuous-batching Scheduler (runtime/drivers/scheduler.py), the CLI and the server.

    request = GenerationRequest.create("Once upon a time", max_new_tokens=16, temperature=0.7, stop=["\\n"])
    generator.generate(request)            # or generator.generate("Once upon a time", max_new_tokens=16, ...)
    scheduler.submit(request)

`GenerationRequest.create` is the one place keyword options (greedy / temperature / top_k / top_p /
min_p / penalties / seed overrides, logprobs, n, grammar, speculate / draft_len, ...) become a
request; the dataclass validates itself.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvforge.core.errors import InputError
from kvforge.runtime.controls.logprobs import MAX_LOGPROBS
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.controls.speculate import DEFAULT_DRAFT_LEN, OFF, check_speculation
from kvforge.runtime.text.prompts import Prompts, as_id_list, is_int
from kvforge.runtime.text.tokenizer import IncrementalDetokenizer

DEFAULT_MAX_NEW_TOKENS = 64
MAX_CHOICES = 16  # n at most


class FinishReason(str, enum.Enum):
    """Why a row (a prompt of a batch, or a served request) stopped generating. A str: compares
    equal to its value ("eos" == FinishReason.EOS) and prints and serialises as it."""

    EOS = "eos"  # an end-of-sequence token of the model (not with ignore_eos)
    STOP = "stop"  # a stop token id or a stop string of the request
    LENGTH = "length"  # max_new_tokens generated
    CANCELLED = "cancelled"  # the caller cancelled it (scheduler: the client went away, shutdown)
    ERROR = "error"  # the backend failed while it ran (scheduler)

    # As the plain strings they were: print(result.finish_reason) shows ['eos'], f"{reason}" gives eos
    # (Python 3.11 formats str-mixin enums as "FinishReason.EOS" otherwise).
    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def openai_finish_reason(reason: str) -> str:
    """OpenAI's finish_reason for one of ours: it knows only "length" and "stop" (for us: EOS, a
    stop token or string, and a cancelled request, whose client is gone anyway)."""
    return "length" if reason == FinishReason.LENGTH else "stop"


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: `method` drafts up to `draft_len` tokens per step (runtime/controls/speculate.py).
    Speculation("off"): no speculation for this request, whatever its Scheduler's default (`speculate=`)."""

    method: str = "prompt-lookup"
    draft_len: int = DEFAULT_DRAFT_LEN

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise InputError(f"the speculation method must be a str, got {self.method!r}")
        try:
            check_speculation(self.method, self.draft_len)
        except ValueError as err:
            raise InputError(str(err)) from err

    @property
    def off(self) -> bool:
        return self.method == OFF


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. `prompts`: one text, a batch of texts, one prompt of token ids, a batch of
    token-id rows, or a rendered chat (runtime/text/prompts.py; the scheduler takes one prompt).
    `sampling` is used as given (default greedy); `Generator.request` / `create` resolve keyword
    overrides against the export's generation config instead. Generation of a row ends at an EOS
    token (unless `ignore_eos`), a `stop_token_ids` token, a `stop` string (the text ends before it)
    or `max_new_tokens`. `capacity`: the KV cache size (Generator; default from the lengths).
    `keep_logits` keeps every step's logits (parity).

    `logprobs`: None (off) or k in 0..20: each step's chosen token's log-probability and the k
    most likely tokens (runtime/controls/logprobs.py; log_softmax of the raw logits, before penalties,
    grammar and temperature). `n`: choices per prompt (1..16), each with its own random stream
    (seed + i, see sampling.choice_seed); the Scheduler prefills the prompt once and copies its KV
    rows, the Generator repeats each prompt row n times (result rows prompt-major: p0c0, p0c1, ...).
    `grammar`: a constraint spec whose `matcher(vocabulary)` gives each row a matcher that masks
    the logits (runtime/controls/logit_controls.py; runtime/controls/constraint.py builds them).
    `images` (a vision-language export): one prompt's images, or for a batch of prompts a list per prompt; each a
    file path, bytes, a data: URL, a PIL image or a uint8 array, its place marked in the prompt (runtime/media/)."""

    prompts: Prompts
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    capacity: int | None = None
    ignore_eos: bool = False
    keep_logits: bool = False
    speculation: Speculation | None = None
    logprobs: int | None = None
    n: int = 1
    grammar: Any | None = None
    images: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if not is_int(n) or n < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise InputError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        # Normalise the containers (lists from JSON or keywords) so that the request stays immutable.
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "stop_token_ids", frozenset(as_id_list(self.stop_token_ids, what="stop_token_ids")))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        for flag in ("ignore_eos", "keep_logits"):
            if not isinstance(getattr(self, flag), bool):
                raise InputError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.capacity is not None and not is_int(self.capacity):
            raise InputError(f"capacity must be an integer or None, got {self.capacity!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InputError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS} (the alternatives per step), "
                             f"got {self.logprobs!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise InputError(f"n must be an integer in 1..{MAX_CHOICES} (choices per prompt), got {self.n!r}")
        object.__setattr__(self, "n", int(self.n))
        if self.images is not None:
            if not isinstance(self.images, list | tuple):
                raise InputError(f"images must be a list (of images, or of a list per prompt), got "
                                 f"{type(self.images).__name__}")
            object.__setattr__(self, "images", tuple(tuple(i) if isinstance(i, list) else i for i in self.images))
        if self.speculation is not None:
            if not isinstance(self.speculation, Speculation):
                raise InputError(f"speculation must be a Speculation, got {type(self.speculation).__name__}")
            if self.keep_logits and not self.speculation.off:
                raise InputError("keep_logits is not available with speculative decoding (a step verifies several "
                                 "positions at once); drop speculate")

    @classmethod
    def create(
        cls,
        prompts: Prompts,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        *,
        greedy: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        stop_token_ids: Iterable[int] | int | None = None,
        stop: Iterable[str] | str | None = None,
        capacity: int | None = None,
        ignore_eos: bool = False,
        keep_logits: bool = False,
        speculate: str | None = None,
        draft_len: int = DEFAULT_DRAFT_LEN,
        defaults: SamplingConfig | None = None,
        logprobs: int | None = None,
        n: int = 1,
        grammar: Any | None = None,
        images: Any = None,
    ) -> GenerationRequest:
        """A request from keyword options. The sampling keywords override `defaults` (the export's
        generation config; greedy when None); giving temperature/top_k/top_p/min_p without `greedy`
        means sampling (the penalties apply to greedy decoding too). `speculate` (runtime/controls/speculate.py
        METHODS) drafts up to `draft_len` tokens per step. `logprobs`, `n`, `grammar`: see the class."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:  # checked first: the first error a caller sees
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        config = resolve_sampling(defaults or SamplingConfig(), sampling, greedy=greedy, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                  repetition_penalty=repetition_penalty)
        try:
            check_speculation(speculate, draft_len)
        except ValueError as err:
            raise InputError(str(err)) from err
        return cls(
            prompts, max_new_tokens, config, stop_token_ids=stop_token_ids or frozenset(), stop=stop or (),
            capacity=capacity, ignore_eos=ignore_eos, keep_logits=keep_logits,
            speculation=Speculation(speculate, int(draft_len)) if speculate is not None else None,
            logprobs=logprobs, n=n, grammar=grammar, images=images,
        )

    def replace(self, **changes: Any) -> GenerationRequest:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_sampling(defaults: SamplingConfig, sampling: SamplingConfig | None, **overrides: Any) -> SamplingConfig:
    """`sampling` as given, or `defaults` with the non-None keyword overrides (never both)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if sampling is not None:
        if not isinstance(sampling, SamplingConfig):
            raise InputError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if given:
            raise InputError(f"pass either sampling=SamplingConfig(...) or the keywords {sorted(given)}, not both")
        return sampling
    if given.get("greedy") is True:  # greedy picks the argmax: a temperature or an active filter would be ignored
        ignored = [key for key, off in (("temperature", None), ("top_k", 0), ("top_p", 1), ("min_p", 0))
                   if key in given and given[key] != off]
        if ignored:
            raise InputError(f"greedy decoding ignores {', '.join(f'{k}={given[k]}' for k in ignored)}; ask for one: "
                             "greedy (--greedy, greedy=True) or sampling (those options without it)")
    if "greedy" not in given and any(key in given for key in ("temperature", "top_k", "top_p", "min_p")):
        given["greedy"] = False  # asking for a temperature or a filter means asking to sample
    return defaults.with_overrides(**given)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    values = (stop,) if isinstance(stop, str) else stop
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) and s for s in values):
        raise InputError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(values)


class Stopper:
    """Stop handling of one row, for the Generator's loop and the Scheduler alike: counts its
    tokens, decides when it ends (`reason`) and which of its text is stable and before any stop
    string. Without a detokenizer (token-id prompts) no text is produced and stop strings cannot apply."""

    def __init__(self, request: GenerationRequest, eos_token_ids: frozenset[int],
                 detok: IncrementalDetokenizer | None = None) -> None:
        self.eos = frozenset() if request.ignore_eos else eos_token_ids
        self.stop_ids = request.stop_token_ids
        self.stop = request.stop
        self.max_new_tokens = request.max_new_tokens
        self.detok = detok
        self.generated = 0
        self.reason: FinishReason | None = None
        self._text = ""  # all stable text so far (possibly past a stop string)
        self._sent = 0  # characters of it already returned

    @property
    def text(self) -> str:
        """The text returned so far: everything before the first stop string."""
        return self._text[: self._sent]

    def add(self, token: int) -> str:
        """Count `token` (which must not come after the row ended); set `reason` if it ends the
        row; return the text it lets out ("" while held back)."""
        self.generated += 1
        reason = None
        if token in self.eos:
            reason = FinishReason.EOS
        elif token in self.stop_ids:
            reason = FinishReason.STOP
        elif self.generated >= self.max_new_tokens:
            reason = FinishReason.LENGTH
        if self.detok is None:
            self.reason = reason
            return ""
        # Special tokens (EOS) decode to nothing; the end of the row flushes what the detokenizer holds.
        self._text += self.detok.add(token) + (self.detok.flush() if reason is not None else "")
        upto = len(self._text)
        if self.stop:
            hits = [i for i in (self._text.find(s, max(0, self._sent - len(s))) for s in self.stop) if i >= 0]
            if hits:
                upto, reason = min(hits), FinishReason.STOP
            elif reason is None:
                # Hold back what could be the start of a stop string.
                upto = max(self._sent, len(self._text) - max(len(s) for s in self.stop) + 1)
        delta = self._text[self._sent: upto]
        self._sent = max(self._sent, upto)
        self.reason = reason
        return delta
