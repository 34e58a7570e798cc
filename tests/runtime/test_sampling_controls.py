"""Sampling controls of issue 19: the checks of min_p, penalties, logprobs and n > 1 (no model), and on a
real export logprobs against numpy's log_softmax of the raw logits kept by keep_logits, and n choices
waiting for free rows. Penalties, logprobs in streams and in the Scheduler, n choices against solo seeds
and the grammar hook run on the fake backend (tests/runtime/test_fake_controls.py) against reference loops."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.core.errors import InputError
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.controls.request import resolve_sampling
from kvforge.runtime.controls.sampling import SamplingConfig, filter_logits
from kvforge.runtime.drivers.scheduler import Scheduler

PROMPT = [5, 17, 99, 3, 42, 7]
OTHER = [[20, 21, 22, 23], [300, 12, 12, 8, 90]]


@pytest.fixture(scope="module")
def served(exported):
    generator = Generator(exported("llama-tiny"))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=8).start()
    yield generator, scheduler
    scheduler.close()


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


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


# -- n > 1 --------------------------------------------------------------------------------------------------------
def test_n_waits_for_free_rows_and_too_many_is_refused(served) -> None:
    generator, scheduler = served
    long = scheduler.submit(GenerationRequest.create(OTHER[0], 20, greedy=True, ignore_eos=True))
    wide = scheduler.submit(GenerationRequest.create(PROMPT, 4, n=3, greedy=True, ignore_eos=True))
    solo = generator.generate([PROMPT], max_new_tokens=4, greedy=True, ignore_eos=True).tokens[0]
    assert [tokens for tokens, _, _ in wide.results()] == [solo] * 3
    assert len(long.result()[0]) == 20
    with pytest.raises(InputError, match="n=4 choices need 4 batch rows at once; this server runs 3"):
        scheduler.submit(GenerationRequest.create(PROMPT, 4, n=4))
