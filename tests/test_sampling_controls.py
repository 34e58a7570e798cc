"""Sampling controls of issue 19: min_p, presence / frequency / repetition penalties, logprobs, n > 1
choices and the grammar hook, in the Generator and the Scheduler. References are independent:
numpy log_softmax and a numpy penalty implementation over the raw logits kept by keep_logits."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.core.errors import InputError
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.request import resolve_sampling
from kvforge.runtime.sampling import SamplingConfig, filter_logits
from kvforge.runtime.scheduler import Delta, Done, Scheduler

PROMPT = [5, 17, 99, 3, 42, 7]
OTHER = [[20, 21, 22, 23], [300, 12, 12, 8, 90]]
FRESH = [400, 17, 99, 3, 42, 7]  # no other request starts with 400: the scheduler has nothing of it cached


@pytest.fixture(scope="module")
def served(exported):
    generator = Generator(exported("llama-tiny"))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=8).start()
    yield generator, scheduler
    scheduler.close()


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def ref_penalized(raw: np.ndarray, history: list[int], generated: list[int], repetition: float, presence: float,
                  frequency: float) -> np.ndarray:
    """HF's repetition penalty over prompt + generated, then OpenAI's presence / frequency over generated."""
    out = raw.astype(np.float64)
    for token in set(history):
        out[token] = out[token] * repetition if out[token] < 0 else out[token] / repetition
    for token in set(generated):
        out[token] -= presence + frequency * generated.count(token)
    return out


class AllowOnly:
    """A fake grammar spec: every row may only take tokens from `allowed`; matchers record their tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = sorted(allowed)
        self.matchers: list[AllowOnly.Matcher] = []

    class Matcher:
        def __init__(self, allowed: list[int]) -> None:
            self.allowed = allowed
            self.advanced: list[int] = []

        def apply(self, row: np.ndarray) -> None:
            keep = row[self.allowed].copy()
            row[:] = -np.inf
            row[self.allowed] = keep

        def advance(self, token: int) -> None:
            self.advanced.append(token)

    def matcher(self, vocabulary: object) -> AllowOnly.Matcher:
        self.matchers.append(AllowOnly.Matcher(self.allowed))
        return self.matchers[-1]


# -- configs and filters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number > 0"),
])
def test_bad_sampling_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError) as info:
        SamplingConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "n must be an integer in 1..16"),
    ({"n": 17}, "n must be an integer in 1..16"),
    ({"logprobs": 21}, "logprobs must be None or an integer in 0..20"),
    ({"logprobs": -1}, "logprobs must be None or an integer in 0..20"),
    ({"logprobs": 2, "speculate": "prompt-lookup"}, "logprobs is not available with speculative decoding"),
    ({"repetition_penalty": 1.2, "speculate": "prompt-lookup"}, "penalties is not available with speculative"),
])
def test_bad_request_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError) as info:
        GenerationRequest.create(PROMPT, 4, **kwargs)
    assert message in str(info.value)


def test_min_p_keeps_tokens_within_a_fraction_of_the_most_likely() -> None:
    logits = np.log(np.array([[0.3, 0.05, 0.5, 0.15]], dtype=np.float32))
    kept = [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in filter_logits(logits, min_p=0.5)]
    assert kept == [{0, 2}]  # p >= 0.25
    kept = [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in filter_logits(logits, min_p=0.2)]
    assert kept == [{0, 2, 3}]  # p >= 0.1
    # After top_k=2 ({0.5, 0.3}), min_p=0.7 keeps p >= 0.35 only.
    kept = [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in filter_logits(logits, top_k=2, min_p=0.7)]
    assert kept == [{2}]


def test_min_p_alone_means_sampling_and_penalties_keep_greedy() -> None:
    assert resolve_sampling(SamplingConfig(), None, min_p=0.1).greedy is False
    config = resolve_sampling(SamplingConfig(), None, repetition_penalty=1.3, presence_penalty=0.5)
    assert config.greedy is True and config.penalized


# -- logprobs -----------------------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_the_raw_logits(served) -> None:
    generator, _ = served
    # Sampling at a low temperature with a penalty: logprobs still describe the raw logits.
    result = generator.generate([PROMPT], max_new_tokens=5, temperature=0.5, seed=3, frequency_penalty=1.0,
                                logprobs=4, keep_logits=True, ignore_eos=True)
    assert result.logprobs is not None and len(result.logprobs[0]) == 5
    for step, entry in enumerate(result.logprobs[0]):
        ref = ref_log_softmax(result.logits[step][0])
        assert entry.token == result.tokens[0][step]
        assert entry.logprob == pytest.approx(ref[entry.token], abs=1e-6)
        assert [t for t, _ in entry.top] == np.argsort(-ref, kind="stable")[:4].tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(np.sort(ref)[::-1][:4], abs=1e-6)
    zero = generator.generate([PROMPT], max_new_tokens=2, greedy=True, logprobs=0)
    assert zero.logprobs is not None and all(e.top == () for e in zero.logprobs[0])
    assert generator.generate([PROMPT], max_new_tokens=2).logprobs is None


def test_stream_events_carry_logprobs(served) -> None:
    generator, _ = served
    stream = generator.stream([PROMPT, OTHER[0]], max_new_tokens=3, greedy=True, logprobs=1)
    events = list(stream)
    assert [[e.logprobs[b] for e in events] for b in range(2)] == stream.result.logprobs


def test_scheduler_logprobs_equal_the_generators(served) -> None:
    generator, scheduler = served
    want = generator.generate([PROMPT], max_new_tokens=6, greedy=True, ignore_eos=True, logprobs=3)
    handle = scheduler.submit(GenerationRequest.create(PROMPT, 6, greedy=True, ignore_eos=True, logprobs=3))
    got = [lp for event in handle if isinstance(event, Delta) for lp in event.logprobs]
    assert [e.token for e in got] == want.tokens[0]
    for mine, theirs in zip(got, want.logprobs[0], strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


# -- penalties ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 3.0},
    {"presence_penalty": 2.0, "frequency_penalty": 1.5},
    {"repetition_penalty": 0.5, "frequency_penalty": -1.0},
])
def test_penalties_pick_what_a_reference_implementation_picks(served, penalties: dict) -> None:
    generator, scheduler = served
    # 20 tokens: plain greedy repeats a generated token (at step 19), so presence / frequency count.
    plain = generator.generate([PROMPT], max_new_tokens=20, greedy=True, ignore_eos=True).tokens[0]
    result = generator.generate([PROMPT], max_new_tokens=20, greedy=True, ignore_eos=True, keep_logits=True,
                                **penalties)
    tokens = result.tokens[0]
    assert tokens != plain  # the penalties matter here, so the comparison below can fail
    args = (penalties.get("repetition_penalty", 1.0), penalties.get("presence_penalty", 0.0),
            penalties.get("frequency_penalty", 0.0))
    for step, token in enumerate(tokens):
        expected = ref_penalized(result.logits[step][0], PROMPT + tokens[:step], tokens[:step], *args)
        assert token == int(np.argmax(expected)), step
    handle = scheduler.submit(GenerationRequest.create(PROMPT, 20, greedy=True, ignore_eos=True, **penalties))
    assert handle.result()[0] == tokens


# -- the grammar hook ---------------------------------------------------------------------------------------------
def test_grammar_masks_its_rows_only_inside_one_batch(served) -> None:
    generator, scheduler = served
    spec = AllowOnly({10, 11, 12, 200, 201})
    solo = [generator.generate([p], max_new_tokens=8, greedy=True, ignore_eos=True).tokens[0] for p in OTHER]
    # Generator: every token is the argmax of the raw logits over the allowed set.
    result = generator.generate([PROMPT], max_new_tokens=8, greedy=True, ignore_eos=True, keep_logits=True,
                                grammar=spec)
    allowed = np.array(spec.allowed)
    want = [int(allowed[np.argmax(result.logits[step][0][allowed])]) for step in range(8)]
    assert result.tokens[0] == want and spec.matchers[-1].advanced == want
    # Scheduler: the constrained request and two plain ones share the 3-row batch.
    handles = [scheduler.submit(GenerationRequest.create(PROMPT, 8, greedy=True, ignore_eos=True, grammar=spec))]
    handles += [scheduler.submit(GenerationRequest.create(p, 8, greedy=True, ignore_eos=True)) for p in OTHER]
    outputs = [h.result()[0] for h in handles]
    assert outputs[0] == want and spec.matchers[-1].advanced == want
    assert outputs[1:] == solo


def test_a_grammar_without_a_matcher_is_refused(served) -> None:
    generator, scheduler = served
    message = "constrained decoding needs a grammar spec with a matcher(vocabulary) method"
    with pytest.raises(InputError, match=r"constrained decoding needs a grammar spec .* got dict"):
        generator.stream([PROMPT], max_new_tokens=2, grammar={"type": "json"})
    with pytest.raises(InputError) as info:
        scheduler.submit(GenerationRequest.create(PROMPT, 2, grammar="x"))
    assert message in str(info.value)


# -- n > 1 --------------------------------------------------------------------------------------------------------
def test_n_choices_share_one_prefill_and_draw_like_solo_seeds(served) -> None:
    generator, scheduler = served
    options = dict(temperature=1.5, seed=11, ignore_eos=True)
    solos = [generator.generate([FRESH], max_new_tokens=8, **{**options, "seed": 11 + i}).tokens[0] for i in range(3)]
    assert len({tuple(s) for s in solos}) == 3  # different seeds, different samples: the checks below can fail
    assert generator.generate([FRESH], max_new_tokens=8, n=3, **options).tokens == solos
    before = scheduler.snapshot()["prefilled_tokens"]
    handle = scheduler.submit(GenerationRequest.create(FRESH, 8, n=3, logprobs=0, **options))
    events = list(handle)
    assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1, 2]
    assert isinstance(events[-1], Done) and handle.done is events[-1]
    results = handle.results()
    assert [tokens for tokens, _, _ in results] == solos
    assert scheduler.snapshot()["prefilled_tokens"] - before == len(FRESH)  # one prefill for the three
    assert all((done.prompt_tokens, done.prefilled_tokens, done.cached_tokens, done.completion_tokens)
               == (len(FRESH), len(FRESH), 0, 8) for _, _, done in results)
    with pytest.raises(InputError, match="this request has n=3 choices: use results()"):
        handle.result()


def test_n_waits_for_free_rows_and_too_many_is_refused(served) -> None:
    generator, scheduler = served
    long = scheduler.submit(GenerationRequest.create(OTHER[0], 20, greedy=True, ignore_eos=True))
    wide = scheduler.submit(GenerationRequest.create(PROMPT, 4, n=3, greedy=True, ignore_eos=True))
    solo = generator.generate([PROMPT], max_new_tokens=4, greedy=True, ignore_eos=True).tokens[0]
    assert [tokens for tokens, _, _ in wide.results()] == [solo] * 3
    assert len(long.result()[0]) == 20
    with pytest.raises(InputError, match="n=4 choices need 4 batch rows at once; this server runs 3"):
        scheduler.submit(GenerationRequest.create(PROMPT, 4, n=4))
