"""Constrained decoding with llguidance: a JSON schema, any JSON object, a regex or a Lark grammar
limits which tokens a row may produce, one token mask per step.

    grammar = Grammar.json_schema(MyPydanticModel)          # or .json_object(), .regex(r"\\d+"), .lark(text)
    gen.generate(prompt, grammar=grammar)

    compiled = compiler_for(gen).compile(grammar)            # InputError with llguidance's message if it cannot
    matcher = compiled.matcher()                             # one per row
    matcher.apply(logits_row)                                # disallowed tokens -> -inf, in place
    matcher.advance(token)                                   # the token the row produced

The grammar is compiled once per (export, grammar) and cached; each row gets a copy of the compiled
matcher. Once the grammar is complete the only token allowed is one of the export's EOS tokens.
The runtime stays torch-free: llguidance.numpy fills the bitmask, numpy applies it.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from kvforge.core.errors import GrammarError, InputError

if TYPE_CHECKING:
    from kvforge.runtime.text.vocabulary import Vocabulary

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")

# JSON is generated the way json.dumps writes it (", " and ": ", no other whitespace): flexible
# whitespace lets a weak model pad forever with newlines. A schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_CACHE_SIZE = 64
# llguidance's default limits, with errors that do not carry its parser state (a 228 KB dump for a
# 3,000-branch anyOf): a client's grammar error goes back to the client.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Tokens a compiled grammar is walked through before a request is admitted (see GrammarCompiler._trial).
TRIAL_STEPS = 8
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Grammar:
    """What a constrained row must produce. `kind`: "json_schema" (`source`: the schema, a dict),
    "json_object" (any JSON object; `source` None), "regex" or "lark" (`source`: the pattern or the
    grammar text, llguidance's Lark dialect). Build one with the class methods."""

    kind: str
    source: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InputError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}; got {self.kind!r}")
        if self.kind == "json_schema":
            if not isinstance(self.source, dict):
                raise InputError(f"a json_schema grammar needs the schema as a dict, got {type(self.source).__name__}")
            try:  # a private, JSON-clean copy: the caller's dict may change later
                object.__setattr__(self, "source", json.loads(json.dumps(self.source)))
            except (TypeError, ValueError) as err:
                raise InputError(f"the JSON schema is not JSON-serialisable: {err}") from None
        elif self.kind == "json_object":
            if self.source is not None:
                raise InputError("a json_object grammar takes no source")
        elif not isinstance(self.source, str) or not self.source:
            raise InputError(f"a {self.kind} grammar needs its text as a non-empty str, got {self.source!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | type) -> Grammar:
        """From a JSON schema: a dict, its JSON text, or a Pydantic model class."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise InputError(f"the JSON schema is not valid JSON: {err}") from None
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that fully matches `pattern` (Rust regex syntax, close to Python's `re`)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Text of a Lark grammar (llguidance's dialect: `start: ...`, /regex/ terminals, %json {...})."""
        return cls("lark", text)

    @property
    def key(self) -> str:
        """A canonical text of the grammar (the compile cache's key)."""
        source = json.dumps(self.source, sort_keys=True) if isinstance(self.source, dict) else self.source
        return f"{self.kind}:{source}"

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (not yet checked)."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        schema = self.source if self.kind == "json_schema" else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as err:  # not a JSON object, or bad x-guidance options
            raise InputError(f"the json_schema grammar cannot be compiled: {err}") from None

    def matcher(self, vocabulary: Vocabulary) -> GrammarMatcher:
        """A fresh matcher for one row over `vocabulary` (compiled once per export and grammar)."""
        return compiler_for(vocabulary).compile(self).matcher()


class GrammarMatcher:
    """The grammar state of one row: `apply` masks a [V] float32 logits row in place, `advance`
    feeds the token the row produced."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_vocab: int) -> None:
        self._matcher = matcher
        self.mask_vocab = mask_vocab
        self.bitmask = llnp.allocate_token_bitmask(1, mask_vocab)

    def fill(self, bitmask: np.ndarray | None = None, index: int = 0) -> None:
        """Compute the allowed tokens into row `index` of `bitmask` (default: this matcher's own)."""
        llnp.fill_next_token_bitmask(self._matcher, self.bitmask if bitmask is None else bitmask, index)
        self._check()

    def apply(self, logits_row: np.ndarray) -> None:
        """Set the tokens the grammar does not allow next to -inf, in place."""
        self.fill()
        mask_logits(logits_row, self.bitmask[0])

    def advance(self, token: int) -> None:
        """Feed the token the row produced (after `apply`, it is always an allowed one)."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar failed at token {int(token)}: {short_error(self._matcher.get_error())}")

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (the row may end here)."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but an EOS token may follow (the grammar is complete, or EOS was fed)."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {short_error(self._matcher.get_error())}")


def short_error(message: str) -> str:
    """llguidance's error on one line, without parser state, at most MAX_ERROR_CHARS characters."""
    for marker in ("<state>", "<non-verbose/>"):
        message = message.split(marker)[0]
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def mask_logits(logits_row: np.ndarray, bitmask_row: np.ndarray) -> None:
    """logits_row[t] = -inf where bit t of the int32 bitmask row is 0 (tokens past the mask too).
    Same result as llguidance.numpy.apply_token_bitmask_inplace, about 3x faster at a 49152
    vocabulary (that one expands the mask with np.repeat / np.tile)."""
    # Bits are little-endian within each 32-bit word: view the words' bytes in that order.
    bits = np.unpackbits(bitmask_row.astype("<i4", copy=False).view(np.uint8), count=logits_row.shape[-1],
                         bitorder="little")
    np.putmask(logits_row, bits == 0, -np.inf)


def apply_batch(logits: np.ndarray, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Mask each row b of [B, V] `logits` that has a matcher (None: untouched), computing the rows'
    masks in parallel with llguidance's executor."""
    rows = [(b, m) for b, m in enumerate(matchers) if m is not None]
    if len(rows) == 1:
        b, m = rows[0]
        m.apply(logits[b])
        return
    if not rows:
        return
    bitmask = llnp.allocate_token_bitmask(len(rows), rows[0][1].mask_vocab)
    llnp.fill_next_token_bitmask_par(_executor(), [(m._matcher, i) for i, (_, m) in enumerate(rows)], bitmask)
    for i, (b, m) in enumerate(rows):
        m._check()
        mask_logits(logits[b], bitmask[i])


class CompiledGrammar:
    """A grammar checked against one tokenizer; `matcher()` copies its initial state for a row."""

    def __init__(self, grammar: Grammar, prototype: llguidance.LLMatcher, mask_vocab: int) -> None:
        self.grammar = grammar
        self._prototype = prototype
        self._mask_vocab = mask_vocab

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self._mask_vocab)


class GrammarCompiler:
    """Compiles grammars for one tokenizer (a `tokenizers` tokenizer.json text), whose EOS ids end a
    finished grammar; `vocab_size` is the model's logits width (it may exceed the tokenizer's)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        hf = HFTokenizer.from_str(tokenizer_json)
        hf.no_padding()  # as llguidance.hf does: padding or truncation would change what it tokenizes
        hf.no_truncation()
        eos = sorted(int(t) for t in eos_token_ids) or None
        n_vocab = max(int(vocab_size), hf.get_vocab_size(with_added_tokens=True))
        # Building the token trie takes ~0.5 s at a 49k vocabulary: done once per compiler.
        self.tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=n_vocab, eos_token=eos)
        self._eos = tuple(eos or ())
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()  # grammars refused, with the message
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The compiled grammar (cached), or InputError with llguidance's message."""
        if not isinstance(grammar, Grammar):
            raise InputError(f"grammar must be a Grammar, got {type(grammar).__name__}")
        key = grammar.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # Outside the lock: a large grammar takes a while (llguidance drops the GIL meanwhile).
        with self._lock:
            refused = self._refused.get(key)
        if refused is not None:
            raise InputError(refused)
        prototype = llguidance.LLMatcher(self.tokenizer, grammar.llguidance_grammar(), log_level=0, limits=LIMITS)
        if prototype.is_error():
            message = f"the {grammar.kind} grammar cannot be compiled: {short_error(prototype.get_error())}"
        else:
            failure = self._trial(prototype)
            message = None if failure is None else (
                f"the {grammar.kind} grammar cannot be used: {failure} (met in its first {TRIAL_STEPS} tokens)")
        if message is not None:
            with self._lock:  # refused again at once: a hostile grammar costs its compile time only once
                self._remember(self._refused, key, message)
            del prototype
            release_free_memory()
            raise InputError(message)
        compiled = CompiledGrammar(grammar, prototype, self.tokenizer.vocab_size)
        with self._lock:
            self._remember(self._cache, key, compiled)
        return compiled

    def _trial(self, prototype: llguidance.LLMatcher) -> str | None:
        """Walk a copy of the grammar through its first TRIAL_STEPS tokens (each time the lowest allowed
        id that is not EOS): llguidance's limits (lexer fuel, row size) are met there by grammars that
        compile, and would otherwise fail the request after it was admitted. Its error, or None."""
        matcher = prototype.deep_copy()
        bitmask = llnp.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        eos = set(self._eos)
        for _ in range(TRIAL_STEPS):
            llnp.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error():
                return short_error(matcher.get_error())
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].astype("<i4", copy=False).view(np.uint8),
                                                   bitorder="little"))
            token = next((int(t) for t in allowed if int(t) not in eos), None)
            if token is None:
                return None  # only EOS may follow: the grammar is complete
            if not matcher.consume_token(token):
                return short_error(matcher.get_error())
        return None

    @staticmethod
    def _remember(cache: OrderedDict, key: str, value: Any) -> None:
        cache[key] = value
        while len(cache) > COMPILED_CACHE_SIZE:
            cache.popitem(last=False)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). A
    hostile grammar's compile or trial can allocate hundreds of MB in llguidance before it is refused;
    freed, that memory otherwise stays in the process for good (a soak's RSS grew 136 MB from one)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim() -> Any:
    global _trim
    if _trim is None:
        import ctypes
        import ctypes.util

        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
            _trim = False
    return _trim or None


_trim: Any = None
_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()
_executor_instance: llguidance.LLExecutor | None = None


def compiler_for(vocabulary: Vocabulary) -> GrammarCompiler:
    """The GrammarCompiler of an export's vocabulary (Generator.vocabulary), built on first use and kept
    while the vocabulary lives."""
    with _compilers_lock:
        compiler = _compilers.get(vocabulary)
        if compiler is None:
            if vocabulary.tokenizer is None:
                raise InputError(f"constrained decoding needs the export's tokenizer.json; {vocabulary.folder} has none")
            compiler = GrammarCompiler(vocabulary.tokenizer.to_json(), vocabulary.vocab_size, vocabulary.eos_token_ids)
            _compilers[vocabulary] = compiler
        return compiler


def _executor() -> llguidance.LLExecutor:
    global _executor_instance
    if _executor_instance is None:
        _executor_instance = llguidance.LLExecutor()
    return _executor_instance
