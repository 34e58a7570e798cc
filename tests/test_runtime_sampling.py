"""Sampling: filters keep the sets Hugging Face's warpers keep, seeds reproduce, configs validate."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.errors import InputError
from kvforge.runtime.sampling import Sampler, SamplingConfig, filter_logits, greedy, sample


def log_probs(*probs: float) -> np.ndarray:
    return np.log(np.array([probs], dtype=np.float32))


def kept(logits: np.ndarray) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in logits]


def test_greedy_is_argmax_per_row() -> None:
    logits = np.array([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    assert greedy(logits).tolist() == [1, 0]
    assert sample(logits, SamplingConfig(greedy=True), np.random.default_rng(0)).tolist() == [1, 0]


def test_top_k_keeps_the_k_largest() -> None:
    logits = np.array([[0.5, 4.0, -2.0, 3.0, 1.0], [9.0, 8.0, 7.0, 6.0, 5.0]], dtype=np.float32)
    assert kept(filter_logits(logits, top_k=2)) == [{1, 3}, {0, 1}]
    assert kept(filter_logits(logits, top_k=0)) == [set(range(5))] * 2  # 0 disables
    assert kept(filter_logits(logits, top_k=9)) == [set(range(5))] * 2  # k >= V keeps all


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    assert kept(filter_logits(logits, top_k=1)) == [{1, 2}]


@pytest.mark.parametrize(
    ("top_p", "want"),
    [
        (0.5, {0}),  # the first token alone reaches 0.5
        (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8
        (0.81, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (0.01, {0}),  # at least one token always stays
    ],
)
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p: float, want: set[int]) -> None:
    # Shuffled order, so the filter must sort: probabilities 0.5, 0.3, 0.15, 0.05 at indices 2, 0, 3, 1.
    logits = log_probs(0.3, 0.05, 0.5, 0.15)
    relabel = {0: 2, 1: 0, 2: 3, 3: 1}
    assert kept(filter_logits(logits, top_p=top_p)) == [{relabel[i] for i in want}]


def test_samples_stay_inside_the_filtered_set_and_follow_probabilities() -> None:
    logits = np.repeat(log_probs(0.4, 0.3, 0.2, 0.1), 2000, axis=0)
    config = SamplingConfig(greedy=False, top_k=2, seed=3)
    picks = sample(logits, config, np.random.default_rng(config.seed))
    assert set(picks.tolist()) == {0, 1}
    # After top-k the two kept tokens have mass 0.4/0.7 and 0.3/0.7.
    assert abs(np.mean(picks == 0) - 4 / 7) < 0.04


def test_temperature_sharpens_and_flattens() -> None:
    logits = np.repeat(log_probs(0.6, 0.4), 4000, axis=0)
    cold = sample(logits, SamplingConfig(greedy=False, temperature=0.25, seed=1), np.random.default_rng(1))
    hot = sample(logits, SamplingConfig(greedy=False, temperature=4.0, seed=1), np.random.default_rng(1))
    # p0 at T: 0.6^(1/T) / (0.6^(1/T) + 0.4^(1/T)): T=0.25 -> 0.835, T=4 -> 0.525.
    assert abs(np.mean(cold == 0) - 0.835) < 0.03
    assert abs(np.mean(hot == 0) - 0.525) < 0.03


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = np.array([[-np.inf, 0.0, -np.inf, 0.0]] * 5000, dtype=np.float32)
    picks = sample(logits, SamplingConfig(greedy=False, seed=0), np.random.default_rng(0))
    assert set(picks.tolist()) == {1, 3}


def test_seed_reproduces_and_differs_across_seeds() -> None:
    logits = np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32)
    config = SamplingConfig(greedy=False, temperature=1.0, seed=11)
    sampler = Sampler(config)
    first_steps = [sampler(logits).tolist() for _ in range(3)]
    replay = Sampler(config)
    assert [replay(logits).tolist() for _ in range(3)] == first_steps
    runs = {tuple(Sampler(SamplingConfig(greedy=False, seed=s))(logits).tolist()) for s in range(8)}
    assert len(runs) > 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_invalid_configs_raise_input_error(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError) as info:
        SamplingConfig(**kwargs)
    assert message in str(info.value)


def test_defaults_from_generation_dict() -> None:
    assert SamplingConfig.from_generation(None) == SamplingConfig(greedy=True)
    assert SamplingConfig.from_generation({"do_sample": False, "temperature": 0.0}).greedy is True
    config = SamplingConfig.from_generation({"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    assert config == SamplingConfig(greedy=False, temperature=0.7, top_k=50, top_p=0.9)  # HF's default top_k
    assert SamplingConfig.from_generation({"do_sample": True, "top_k": 0}).top_k == 0


def test_overrides_are_validated() -> None:
    base = SamplingConfig()
    assert base.with_overrides(top_k=5, top_p=None).top_k == 5
    with pytest.raises(InputError, match="top_p"):
        base.with_overrides(top_p=2.0)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_is_the_greedy_limit_without_overflow(temperature: float) -> None:
    import warnings

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 5
    config = SamplingConfig(greedy=False, temperature=temperature, top_k=0, top_p=1.0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow / invalid-value warnings fail the test
        picks = sample(logits, config, rng)
    assert picks.tolist() == greedy(logits).tolist()


def test_negative_seed_is_refused() -> None:
    with pytest.raises(InputError, match="seed must be an integer >= 0 or None, got -1"):
        SamplingConfig(seed=-1)
