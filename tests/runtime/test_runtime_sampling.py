"""Sampling: filters keep the sets Hugging Face's warpers keep, seeds reproduce, configs validate."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.core.errors import InputError
from kvforge.runtime.controls.sampling import Sampler, SamplingConfig, filter_logits, greedy, sample


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


# -- top-p without the full sort: equal to the implementation that sorted every row whole -----------

def _reference_filter_logits(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0,
                             min_p: float = 0.0) -> np.ndarray:
    """filter_logits as it was: top-p by a full stable argsort of every row."""
    out = np.array(logits, dtype=np.float64 if logits.dtype == np.float64 else np.float32, copy=True)
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(out, vocab - top_k, axis=-1)[:, vocab - top_k : vocab - top_k + 1]
        out[out < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(out, order, axis=-1)
        shifted = sorted_logits - sorted_logits.max(axis=-1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
        mass_before = np.cumsum(probs, axis=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        out[remove] = -np.inf
    if min_p > 0.0:
        floor = out.max(axis=-1, keepdims=True) + np.log(min_p)
        out[out < floor] = -np.inf
    return out


def _rows(kind: str, rng: np.random.Generator, count: int, vocab: int) -> np.ndarray:
    normal = rng.standard_normal((count, vocab))
    if kind == "flat":  # nucleus of thousands of tokens: beyond the candidates
        return normal * 0.5
    if kind == "peaked":
        return normal * rng.uniform(3, 8, (count, 1))
    if kind == "ties":  # few distinct values: long runs of equal logits at every boundary
        return np.round(normal * 3) / 2
    if kind == "zipf":  # a real model's shape: log-probabilities of a shuffled power law
        ranks = rng.permuted(np.tile(np.arange(1, vocab + 1), (count, 1)), axis=-1)
        return -1.1 * np.log(ranks)
    raise AssertionError(kind)


def _assert_same(logits: np.ndarray, **filters) -> None:
    got = filter_logits(logits, **filters)
    want = _reference_filter_logits(logits, **filters)
    assert got.dtype == want.dtype
    assert np.array_equal(got, want), [np.flatnonzero(g != w)[:5] for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "zipf"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_top_p_equals_the_full_sort(kind: str, dtype: type) -> None:
    rng = np.random.default_rng([len(kind), np.dtype(dtype).itemsize])
    for top_p in (0.05, 0.5, 0.9, 0.99, 0.999999, 1 - 1e-12):
        logits = _rows(kind, rng, 6, 3000).astype(dtype)
        _assert_same(logits, top_p=top_p)
        _assert_same(logits / 0.7, top_p=top_p)


@pytest.mark.parametrize("top_k", [1, 50, 1024, 2000])
def test_top_p_after_top_k_equals_the_full_sort(top_k: int) -> None:
    # -inf entries: top-k leaves fewer finite tokens than candidates (or more, for 2000).
    rng = np.random.default_rng(top_k)
    for kind in ("flat", "peaked", "ties"):
        logits = _rows(kind, rng, 4, 3000)
        for top_p in (0.3, 0.9, 0.999999):
            _assert_same(logits, top_k=top_k, top_p=top_p)
            _assert_same(logits, top_k=top_k, top_p=top_p, min_p=0.05)


def test_top_p_ties_straddling_the_candidates_equal_the_full_sort() -> None:
    # 1000 distinct leading values, then 500 equal ones at every index order: the 1024 candidates
    # take 24 of the tied run, the nucleus ends inside it or just before it.
    rng = np.random.default_rng(5)
    vocab = 4000
    for top_p in (0.2, 0.6, 0.7, 0.75, 0.8, 0.95):
        logits = np.full((3, vocab), -30.0)
        for row in logits:
            index = rng.permutation(vocab)
            row[index[:1000]] = np.sort(rng.uniform(-2.0, 0.0, 1000))
            row[index[1000:1500]] = -2.5
        _assert_same(logits, top_p=top_p)


def test_top_p_at_an_exact_mass_boundary_equals_the_full_sort() -> None:
    # top_p equal to the mass of the first tokens, up to rounding: the decisions sit on the boundary.
    probs = np.full(3000, 0.2 / 2997)
    probs[[7, 100, 2500]] = [0.5, 0.2, 0.1]
    logits = np.log(probs)[None]
    for top_p in (0.5, 0.7, 0.8, 0.8 + 1e-13, 0.8 - 1e-13):
        _assert_same(logits, top_p=top_p)
        _assert_same(logits.astype(np.float32), top_p=top_p)


def test_top_p_on_a_mixed_batch_of_the_full_vocabulary_equals_the_full_sort() -> None:
    rng = np.random.default_rng(7)
    vocab = 49152
    logits = np.concatenate([_rows(kind, rng, 1, vocab) for kind in ("flat", "peaked", "ties", "zipf")])
    logits[1, rng.choice(vocab, 20000, replace=False)] = -np.inf
    for top_p in (0.9, 0.999):
        _assert_same(logits / 0.7, top_p=top_p)
        _assert_same(logits.astype(np.float32), top_p=top_p)


def test_top_p_rows_of_all_minus_inf_or_nan_are_left_as_the_full_sort_leaves_them() -> None:
    logits = np.random.default_rng(1).standard_normal((3, 2000))
    logits[0] = -np.inf
    logits[1, 5] = np.nan
    with np.errstate(invalid="ignore"):
        got = filter_logits(logits, top_p=0.9)
        want = _reference_filter_logits(logits, top_p=0.9)
    assert np.array_equal(got, want, equal_nan=True)


def test_top_p_takes_the_cheap_ways_when_they_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.runtime.controls import sampling

    calls: list[str] = []
    for name in ("_top_p_sorted_values", "_top_p_full"):
        real_way = getattr(sampling, name)
        monkeypatch.setattr(sampling, name, lambda rows, top_p, _f=real_way, _n=name: (calls.append(_n), _f(rows, top_p))[1])
    rng = np.random.default_rng(3)
    peaked = _rows("peaked", rng, 4, 5000)
    _assert_same(peaked, top_p=0.9)
    # After top-k, the -inf candidates stand for every token outside: whatever top-p makes of them.
    _assert_same(_rows("flat", rng, 2, 5000), top_k=50, top_p=1 - 1e-13)
    assert calls == []  # the candidates were enough
    _assert_same(_rows("flat", rng, 2, 5000), top_p=0.9)
    assert calls == ["_top_p_sorted_values"]

    # The last resort (full stable sort), forced, gives the same.
    monkeypatch.setattr(sampling, "_top_p_sorted_values", lambda rows, top_p: (rows, np.zeros(len(rows), bool)))
    _assert_same(_rows("flat", rng, 2, 5000), top_p=0.9)
    assert calls[-1] == "_top_p_full"


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(greedy=False, temperature=0.7, top_p=0.9, seed=1),
        SamplingConfig(greedy=False, temperature=1.3, top_p=0.95, top_k=50, seed=2),
        SamplingConfig(greedy=False, temperature=0.7, top_p=0.8, min_p=0.02, seed=3),
    ],
)
def test_sample_with_top_p_draws_the_tokens_of_the_full_sort(config: SamplingConfig,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.runtime.controls import sampling

    rng = np.random.default_rng(config.seed)
    logits = np.concatenate([_rows(kind, rng, 2, 5000) for kind in ("flat", "peaked", "ties", "zipf")])
    logits = logits.astype(np.float32)
    sampler = Sampler(config)
    got = [sampler(logits).tolist() for _ in range(5)]
    per_row = sample(logits, config, [np.random.default_rng(s) for s in range(len(logits))]).tolist()

    monkeypatch.setattr(sampling, "filter_logits", _reference_filter_logits)
    reference = Sampler(config)
    assert [reference(logits).tolist() for _ in range(5)] == got
    assert sample(logits, config, [np.random.default_rng(s) for s in range(len(logits))]).tolist() == per_row
