"""Constrained decoding (runtime/controls/constraint.py): random logits masked by a grammar must still give
text the grammar accepts; grammars that cannot compile are InputErrors with llguidance's message."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance.numpy as llnp
import numpy as np
import pydantic
import pytest

from kvforge.core.errors import InputError
from kvforge.models.tokenizer import EOS_ID, build_tokenizer
from kvforge.runtime.controls.constraint import (
    Grammar,
    GrammarCompiler,
    apply_batch,
    compiler_for,
    mask_logits,
)

VOCAB = 512
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["name", "age", "tag", "ok", "scores"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@example\.(com|org)"
LARK = 'start: "(" item ("," item){0,3} ")"\nitem: /[0-9]{1,3}/ | "foo" | "bar"\n'
LARK_AS_REGEX = r"\((\d{1,3}|foo|bar)(,(\d{1,3}|foo|bar)){0,3}\)"


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode
    name: str = pydantic.Field(max_length=10)
    level: int = pydantic.Field(ge=1, le=9)
    colour: str = pydantic.Field(pattern="^(red|blue)$")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.to_str(), VOCAB, [EOS_ID])


def drive(compiler, tokenizer, grammar, seed, max_tokens=300, bias=None, vocab=VOCAB):
    """Greedy over seeded random logits (plus `bias`), masked by the grammar, until EOS: the text."""
    rng = np.random.default_rng(seed)
    matcher = compiler.compile(grammar).matcher()
    out: list[int] = []
    for _ in range(max_tokens):
        logits = rng.standard_normal(vocab).astype(np.float32) + (0 if bias is None else bias)
        matcher.apply(logits)
        token = int(np.argmax(logits))
        if token == EOS_ID:
            assert matcher.accepting
            return tokenizer.decode(out)
        matcher.advance(token)
        out.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_is_valid(compiler, tokenizer, seed) -> None:
    text = drive(compiler, tokenizer, Grammar.json_schema(SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_pydantic_model_output_parses(compiler, tokenizer) -> None:
    for seed in range(3):
        person = Person.model_validate_json(drive(compiler, tokenizer, Grammar.json_schema(Person), seed))
        assert 1 <= person.level <= 9 and person.colour in ("red", "blue")


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_fully_matches(compiler, tokenizer, seed) -> None:
    text = drive(compiler, tokenizer, Grammar.regex(EMAIL), seed)
    assert re.fullmatch(EMAIL, text), text


@pytest.mark.parametrize("seed", range(4))
def test_lark_output_is_in_the_language(compiler, tokenizer, seed) -> None:
    text = drive(compiler, tokenizer, Grammar.lark(LARK), seed)
    assert re.fullmatch(LARK_AS_REGEX, text), text


def test_json_object_output_is_an_object(compiler, tokenizer) -> None:
    # Unbiased random logits write strings forever; a nudge to the closing tokens lets them end.
    bias = np.zeros(VOCAB, np.float32)
    bias[[tokenizer.token_to_id(c) for c in ('"', "}", "]")]] = 3.0
    for seed in range(3):
        assert isinstance(json.loads(drive(compiler, tokenizer, Grammar.json_object(), seed, bias=bias)), dict)


def test_finished_grammar_allows_only_eos(compiler, tokenizer) -> None:
    matcher = compiler.compile(Grammar.regex("ab")).matcher()
    for token in tokenizer.encode("ab", add_special_tokens=False).ids:
        matcher.advance(token)
    logits = np.zeros(VOCAB, np.float32)
    matcher.apply(logits)
    assert np.flatnonzero(np.isfinite(logits)).tolist() == [EOS_ID]
    assert matcher.finished


def test_rejected_token_raises(compiler, tokenizer) -> None:
    from kvforge.core.errors import GrammarError

    matcher = compiler.compile(Grammar.regex("[0-9]+")).matcher()
    with pytest.raises(GrammarError, match=r"^the grammar failed at token \d+: ") as err:
        matcher.advance(tokenizer.token_to_id("a"))
    assert "<state>" not in str(err.value) and len(str(err.value)) < 400


def test_mask_equals_llguidance_reference(compiler, tokenizer) -> None:
    matcher = compiler.compile(Grammar.json_schema(SCHEMA)).matcher()
    for token in tokenizer.encode('{"name": "ab', add_special_tokens=False).ids:
        matcher.advance(token)
    matcher.fill()
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    ours, reference = logits.copy(), logits.copy()[None]
    mask_logits(ours, matcher.bitmask[0])
    llnp.apply_token_bitmask_inplace(reference, matcher.bitmask)
    assert 0 < np.isfinite(ours).sum() < VOCAB
    np.testing.assert_array_equal(ours, reference[0])


def test_logits_wider_than_the_tokenizer_are_masked(tokenizer) -> None:
    # The model's vocab_size (logits width) may exceed the tokenizer's: those ids are never allowed.
    wide = GrammarCompiler(tokenizer.to_str(), VOCAB + 100, [EOS_ID])
    logits = np.full(VOCAB + 100, 5.0, np.float32)
    wide.compile(Grammar.json_object()).matcher().apply(logits)
    assert np.isneginf(logits[VOCAB:]).all() and np.isfinite(logits[:VOCAB]).any()
    assert drive(wide, tokenizer, Grammar.regex(EMAIL), 0, vocab=VOCAB + 100)


def test_apply_batch_leaves_unconstrained_rows_alone(compiler) -> None:
    logits = np.random.default_rng(1).standard_normal((3, VOCAB)).astype(np.float32)
    original = logits.copy()
    rows = [compiler.compile(Grammar.regex(EMAIL)).matcher(), None, compiler.compile(Grammar.json_object()).matcher()]
    apply_batch(logits, rows)
    np.testing.assert_array_equal(logits[1], original[1])
    for b in (0, 2):
        one = original[b].copy()
        rows[b].apply(one)
        np.testing.assert_array_equal(logits[b], one)
        assert np.isneginf(logits[b]).any()


def test_compiled_grammars_are_cached(compiler) -> None:
    first = compiler.compile(Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.compile(Grammar.json_schema('{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert first is again


@pytest.mark.parametrize("grammar, message", [
    (Grammar.json_schema({"type": "foo"}), "Invalid type: foo"),
    (Grammar.regex("[a-"), "unclosed character class"),
    (Grammar.lark("start: foo"), 'unknown name: "foo"'),
    (Grammar.json_schema({"type": "string", "pattern": "(?<=a)b"}), "look-around"),
])
def test_uncompilable_grammar_is_input_error(compiler, grammar, message) -> None:
    with pytest.raises(InputError, match=f"(?s)the {grammar.kind} grammar cannot be compiled: .*{re.escape(message)}"):
        compiler.compile(grammar)


# Grammars that compile but meet llguidance's limits on their first tokens (found by a hostile probe of
# the server: they failed every running request, then answered 500 with a 228 KB parser-state dump).
HOSTILE = [
    (Grammar.regex("a{1000}{1000}"), "too many expressions"),
    (Grammar.json_schema({"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                                    for i in range(3000)]}), "max is 2000"),
]


@pytest.mark.parametrize("grammar, message", HOSTILE, ids=["regex-repeat", "anyOf-3000"])
def test_grammars_that_fail_on_their_first_tokens_are_refused_at_compile(compiler, grammar, message) -> None:
    with pytest.raises(InputError, match=f"^the {grammar.kind} grammar cannot be used: .*{message}") as err:
        compiler.compile(grammar)
    assert len(str(err.value)) < 400 and "<state>" not in str(err.value)
    with pytest.raises(InputError, match="cannot be used"):  # refused again from the record, not recompiled
        compiler.compile(grammar)
    assert grammar.key in compiler._refused


def test_a_large_grammar_within_the_limits_is_accepted(compiler, tokenizer) -> None:
    grammar = Grammar.json_schema({"anyOf": [{"const": i} for i in range(1500)]})
    text = drive(compiler, tokenizer, grammar, seed=0)
    assert 0 <= json.loads(text) < 1500


@pytest.mark.parametrize("make, message", [
    (lambda: Grammar("xml", "<a/>"), "grammar kind must be one of"),
    (lambda: Grammar.json_schema([1, 2]), "needs the schema as a dict"),
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.json_schema({"default": object()}), "not JSON-serialisable"),
    (lambda: Grammar.regex(""), "non-empty str"),
    (lambda: Grammar("json_object", "x"), "takes no source"),
])
def test_bad_grammar_values(make, message) -> None:
    with pytest.raises(InputError, match=message):
        make()


def test_generator_without_tokenizer_is_input_error(tmp_path) -> None:
    class NoTokenizer:  # what compiler_for reads of a Vocabulary
        tokenizer = None
        folder = tmp_path

    with pytest.raises(InputError, match="needs the export's tokenizer.json"):
        compiler_for(NoTokenizer())
