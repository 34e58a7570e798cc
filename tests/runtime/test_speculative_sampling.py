"""Speculative sampling keeps the target's distribution (issue 54).

Unit level: one round of the rejection rule (runtime/controls/acceptance.py) over random p and q gives p, by a
chi-square goodness-of-fit test; wrong rules fail it. End to end on the tiny Llama: tokens sampled with
speculation (a draft export, prompt lookup) against tokens sampled without, per position, by a chi-square
two-sample test; a wrong rule patched into verification fails it. Then seeded reproducibility, penalties and
logprobs with speculation. Every draw is seeded, so each test gives the same statistics on every run.

The chi-square survival function is written here (closed form for integer degrees of freedom) so that the
tests need no scipy; test_chi2_sf_matches_scipy checks it where scipy is installed.
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import pytest

from kvforge.runtime.controls.acceptance import draw, keep_drafted, replacement

ALPHA = 0.01  # the level: a correct rule must not be rejected at it
WRONG = 1e-6  # a wrong rule must be rejected far below it (so that neither outcome is a coin toss)


# -- chi-square -----------------------------------------------------------------------------------
def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof), dof >= 1: the regularised upper incomplete gamma Q(dof/2, stat/2)
    in closed form. Q(1, x) = e^-x and Q(1/2, x) = erfc(sqrt x); Q(a + 1, x) = Q(a, x) + x^a e^-x / Gamma(a + 1)
    adds the rest, each term taken in logs so that a large statistic underflows to 0 rather than overflowing."""
    x = stat / 2.0
    if x <= 0.0:
        return 1.0
    if dof % 2 == 0:
        total, powers = 0.0, [i for i in range(dof // 2)]  # a = 1, ..., dof/2: terms x^i / i!, i < dof/2
    else:
        total, powers = math.erfc(math.sqrt(x)), [i + 0.5 for i in range(dof // 2)]  # a = 1/2 + i
    for a in powers:
        total += math.exp(a * math.log(x) - x - math.lgamma(a + 1.0))
    return min(total, 1.0)


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's chi-square of observed `counts` against `probs` -> (statistic, dof, p-value) over the tokens
    `probs` gives mass. A token it gives none, seen even once, is impossible under it: p-value 0."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return stat, dof, 0.0 if counts[~support].any() else chi2_sf(stat, dof)


def two_sample(a: Counter, b: Counter) -> tuple[float, int, float]:
    """Pearson's chi-square test of homogeneity between two samples of tokens (a 2 x bins contingency table)
    -> (statistic, dof, p-value). Tokens too rare for the approximation (fewer than 10 in both samples
    together) are pooled into one bin, that bin into the last kept one if it is itself too small."""
    pooled = a + b
    common = [token for token, n in pooled.most_common() if n >= 10]
    rare = [token for token in pooled if token not in set(common)]
    bins = [[token] for token in common]
    if rare:
        if sum(pooled[t] for t in rare) >= 10 or not bins:
            bins.append(rare)
        else:
            bins[-1].extend(rare)
    table = np.array([[sum(side[t] for t in group) for group in bins] for side in (a, b)], dtype=np.float64)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = len(bins) - 1
    return stat, dof, chi2_sf(stat, dof) if dof > 0 else 1.0


def test_chi2_sf_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 7, 8, 40, 41, 200):
        for stat in (0.1, 1.0, dof * 0.5, float(dof), dof * 2.0, dof + 30.0):
            assert chi2_sf(stat, dof) == pytest.approx(float(stats.chi2.sf(stat, dof)), rel=1e-9, abs=1e-300)
    table_a, table_b = Counter({1: 50, 2: 30, 3: 20, 4: 3}), Counter({1: 40, 2: 45, 3: 15, 4: 4})
    stat, dof, p = two_sample(table_a, table_b)
    ref = stats.chi2_contingency(np.array([[50, 30, 23], [40, 45, 19]]), correction=False)
    assert (stat, dof) == (pytest.approx(ref.statistic), ref.dof) and p == pytest.approx(ref.pvalue)


# -- unit level: one round of the rule ------------------------------------------------------------
VOCAB = 8
TRIALS = 20_000


def _pair(seed: int, q_zeros: Sequence[int] = (1, 2)) -> tuple[np.ndarray, np.ndarray]:
    """Random target and draft distributions over VOCAB tokens, each with two tokens it gives no mass (as top-k
    leaves them): p none to tokens 0 and 1, q none to `q_zeros` (by default supports overlapping but unequal)."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(VOCAB)), rng.dirichlet(np.ones(VOCAB))
    p[[0, 1]] = 0.0
    q[list(q_zeros)] = 0.0
    return p / p.sum(), q / q.sum()


Keep = Callable[[np.ndarray, int, "np.ndarray | None", np.random.Generator], bool]
Replace = Callable[[np.ndarray, int, "np.ndarray | None", np.random.Generator], int]


def _first_tokens(p: np.ndarray, q: np.ndarray | None, seed: int, keep: Keep = keep_drafted,
                  replace: Replace = replacement, fixed: int | None = None) -> np.ndarray:
    """Counts of the first token one round of the rule emits over TRIALS rounds: a draft drawn from q (or the
    token `fixed`, q None: a deterministic draft), kept or replaced."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(TRIALS):
        drafted = draw(q, rng) if q is not None else fixed
        counts[drafted if keep(p, drafted, q, rng) else replace(p, drafted, q, rng)] += 1
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_keeps_the_target_distribution(seed: int) -> None:
    p, q = _pair(seed)
    stat, dof, pvalue = goodness_of_fit(_first_tokens(p, q, seed), p)
    assert pvalue > ALPHA, (stat, dof, pvalue)


@pytest.mark.parametrize("fixed", [2, 5])  # a token p gives no mass, and one it does
def test_rule_with_a_deterministic_draft_keeps_the_target_distribution(fixed: int) -> None:
    p, _ = _pair(3)
    p[2] = 0.0  # token 2 is then certainly replaced, token 5 kept with probability p(5)
    p /= p.sum()
    stat, dof, pvalue = goodness_of_fit(_first_tokens(p, None, 10 + fixed, fixed=fixed), p)
    assert pvalue > ALPHA, (stat, dof, pvalue)


def _always_keep(p: np.ndarray, token: int, q: np.ndarray | None, rng: np.random.Generator) -> bool:
    return True


def _replace_from_p(p: np.ndarray, token: int, q: np.ndarray | None, rng: np.random.Generator) -> int:
    return draw(p, rng)  # wrong: the residual norm(max(p - q, 0)) is what makes the kept + replaced mix p


@pytest.mark.parametrize("keep, replace", [(_always_keep, replacement), (keep_drafted, _replace_from_p)])
def test_wrong_rules_are_rejected(keep: Keep, replace: Replace) -> None:
    # q gives no mass where p gives none, so that it is the statistic that rejects (not an impossible token).
    p, q = _pair(0, q_zeros=(0, 1))
    stat, dof, pvalue = goodness_of_fit(_first_tokens(p, q, 0, keep=keep, replace=replace), p)
    assert pvalue < WRONG, (stat, dof, pvalue)


def test_wrong_rule_with_a_deterministic_draft_is_rejected() -> None:
    # A deterministic draft replaced by a draw from p (the drafted token not excluded) over-weights it.
    p5, _ = _pair(3)
    stat, dof, pvalue = goodness_of_fit(_first_tokens(p5, None, 0, replace=_replace_from_p, fixed=5), p5)
    assert pvalue < WRONG, (stat, dof, pvalue)


# -- end to end on the tiny Llama -----------------------------------------------------------------
# top_k=8 at temperature 1: random weights spread a 512-token vocabulary's mass thinly, and eight tokens per
# position give the test power (position j's marginal then spans up to 8^(j+1) paths, most of them pooled).
SAMPLING = dict(temperature=1.0, top_k=8, ignore_eos=True)
POSITIONS = 4
SEQUENCES = 5_000  # x POSITIONS = 20,000 tokens a side
BATCH = 500
WRONG_SEQUENCES = 1_000  # a wrong rule is caught with fewer
PROMPT = [1, 50, 60, 70, 80, 90]
DRAFT_NOISE = 0.1  # the draft: the target's weights with noise of this relative size (it agrees sometimes)


@pytest.fixture(scope="module")
def target(exported):
    return exported("llama-tiny", "onnx")  # the onnx target verifies a batch of rows in one call


@pytest.fixture(scope="module")
def draft(hf_folder, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama's weights plus seeded noise, exported: a draft with the target's tokenizer whose
    distributions differ from the target's (top-8 total variation 0.18 to 0.74 at the prompt's last positions), so
    that drafts are both kept and replaced."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.export import export_model

    source = hf_folder("llama-tiny")
    root = tmp_path_factory.mktemp("draft")
    model = AutoModelForCausalLM.from_pretrained(source)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn(param.shape, generator=noise) * param.std() * DRAFT_NOISE)
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, root / "hf" / name)
    export_model(root / "hf", root / "export", target="onnx")
    return root / "export"


class Sampled(NamedTuple):
    counts: list[Counter]  # position j -> token -> how many sequences had it there
    drafted: int  # speculation: tokens drafted, and those kept
    accepted: int


def sample_positions(generator, prompt: list[int], seed: int, sequences: int = SEQUENCES, **options) -> Sampled:
    """The token at each position 0..POSITIONS-1 of `sequences` sampled sequences of `prompt` (batches of
    BATCH rows, one seed per batch; a batch's rows draw from one stream, as independent samples)."""
    counts = [Counter() for _ in range(POSITIONS)]
    drafted = accepted = 0
    for i in range(sequences // BATCH):
        result = generator.generate([prompt] * BATCH, max_new_tokens=POSITIONS, seed=seed + i, **SAMPLING, **options)
        drafted, accepted = drafted + result.draft_tokens, accepted + result.accepted_tokens
        for row in result.tokens:
            assert len(row) == POSITIONS
            for j, token in enumerate(row):
                counts[j][token] += 1
    return Sampled(counts, drafted, accepted)


def compare(plain: Sampled, fast: Sampled) -> list[tuple[float, int, float]]:
    """Per position: (statistic, dof, p-value) of the two-sample test between plain and speculative tokens."""
    return [two_sample(a, b) for a, b in zip(plain.counts, fast.counts, strict=True)]


def lookup_prompt(generator) -> list[int]:
    """A prompt whose end repeats its start, so that prompt lookup drafts after many first tokens: [1, 50, 60,
    70], the target's greedy continuation of it, then [50, 60, 70] again."""
    head = [1, 50, 60, 70]
    return [*head, *generator.generate([head], max_new_tokens=12, ignore_eos=True).tokens[0], *head[1:]]


@pytest.fixture(scope="module")
def generator(target, draft):
    from kvforge.runtime import Generator

    return Generator(target, draft=draft)


# Each method's prompt and penalty, the same with and without speculation. The penalties put the row's
# controls into verification (applied position by position); prompt lookup's 0.5 favours repeats, so that its
# drafts (tokens of the context) are in the target's top 8 often enough to be kept now and then.
METHODS = {"draft": dict(repetition_penalty=1.3), "prompt-lookup": dict(repetition_penalty=0.5)}


@pytest.fixture(scope="module")
def plain(generator) -> dict[str, Sampled]:
    """Tokens sampled without speculation, for each method's prompt and penalty."""
    return {method: sample_positions(generator, _prompt(generator, method), seed, **METHODS[method])
            for method, seed in (("draft", 1_000), ("prompt-lookup", 3_000))}


def _prompt(generator, method: str) -> list[int]:
    return PROMPT if method == "draft" else lookup_prompt(generator)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "prompt-lookup"])
def test_speculative_sampling_keeps_the_distribution(generator, plain, method: str) -> None:
    fast = sample_positions(generator, _prompt(generator, method), 2_000, speculate=method, draft_len=3,
                            **METHODS[method])
    results = compare(plain[method], fast)
    print(f"\n{method}: drafted {fast.drafted}, kept {fast.accepted}; per position (chi2, dof, p): {results}")
    assert fast.drafted > SEQUENCES // 2  # drafts were really verified
    assert fast.accepted > SEQUENCES // 20  # and some kept: both branches of the rule ran
    for position, (stat, dof, pvalue) in enumerate(results):
        assert pvalue > ALPHA, (position, stat, dof, pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("method, name, wrong", [
    ("draft", "keep_drafted", _always_keep),
    ("draft", "replacement", _replace_from_p),
    ("prompt-lookup", "keep_drafted", _always_keep),
])
def test_a_wrong_rule_fails_the_test(generator, plain, monkeypatch, method: str, name: str, wrong) -> None:
    monkeypatch.setattr(f"kvforge.runtime.drivers.verification.{name}", wrong)
    fast = sample_positions(generator, _prompt(generator, method), 4_000, sequences=WRONG_SEQUENCES,
                            speculate=method, draft_len=3, **METHODS[method])
    results = compare(plain[method], fast)
    print(f"\nwrong {name} ({method}): per position (chi2, dof, p): {results}")
    assert results[0][2] > ALPHA  # position 0 is the prefill's pick: no rule touches it
    assert min(pvalue for _, _, pvalue in results[1:]) < WRONG, results


def test_rows_of_one_request_draft_independently(generator, monkeypatch) -> None:
    # The rows of a batch share the request's seed; the draft model's draws must still be independent per row
    # (identical streams made rows with the same context draft the same tokens: correlated rows, which the
    # two-sample test above rejected at p ~ 1e-53 at position 1).
    from kvforge.runtime.drivers.draft_model import DraftModelProposer

    first: dict[int, tuple[int, ...]] = {}
    propose = DraftModelProposer.propose

    def recording(self, engine, wants):
        drafts = propose(self, engine, wants)
        for at, drafted in drafts.items():
            first.setdefault(at, tuple(drafted.tokens.tolist()))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    result = generator.generate([PROMPT] * 64, max_new_tokens=POSITIONS, seed=5, speculate="draft", draft_len=3,
                                **SAMPLING)
    by_first_token = defaultdict(list)  # rows with the same context when they first drafted
    for at, row in enumerate(result.tokens):
        by_first_token[row[0]].append(first[at])
    pairs = [pair for drafts in by_first_token.values() for pair in itertools.combinations(drafts, 2)]
    same = sum(a == b for a, b in pairs)
    assert len(pairs) > 50 and same < len(pairs) / 2, (same, len(pairs))


# -- seeded reproducibility, penalties and logprobs with speculation ------------------------------
CONTROLLED = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, ignore_eos=True)


@pytest.mark.parametrize("method", ["draft", "prompt-lookup"])
def test_a_seed_reproduces_speculative_sampling(generator, target, draft, method: str) -> None:
    from kvforge.runtime import Generator

    prompts = [_prompt(generator, method)] * 3
    options = dict(max_new_tokens=16, speculate=method, draft_len=3, **CONTROLLED)
    first = generator.generate(prompts, seed=7, **options)
    assert first.draft_tokens > 0
    assert generator.generate(prompts, seed=7, **options).tokens == first.tokens
    assert Generator(target, draft=draft).generate(prompts, seed=7, **options).tokens == first.tokens
    assert generator.generate(prompts, seed=8, **options).tokens != first.tokens
    # The rows of one request draw apart (one stream for the batch, as without speculation).
    assert len({tuple(row) for row in first.tokens}) == 3


# Penalties that change the greedy path: 1.3 (no repeats) for the draft; 0.7 for prompt lookup, whose drafts
# need repeats (with it, the lookup prompt's greedy run has some drafts kept: the penalty of each kept token
# must be in place before the next position is verified).
@pytest.mark.parametrize("method, penalty", [("draft", 1.3), ("prompt-lookup", 0.7)])
def test_greedy_speculation_with_a_penalty_and_logprobs_equals_plain_greedy(generator, method: str,
                                                                           penalty: float) -> None:
    prompts = [_prompt(generator, method), PROMPT[:4]]
    options = dict(max_new_tokens=16, ignore_eos=True, repetition_penalty=penalty, logprobs=3)
    plain = generator.generate(prompts, **options)
    fast = generator.generate(prompts, speculate=method, draft_len=3, **options)
    assert fast.tokens == plain.tokens
    assert fast.accepted_tokens > 0
    for plain_row, fast_row in zip(plain.logprobs, fast.logprobs, strict=True):
        for a, b in zip(plain_row, fast_row, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-5)


def test_sampled_speculation_logprobs_are_the_raw_log_softmax(generator) -> None:
    # With a penalty the picked distribution is not the model's; logprobs report the model's (raw logits).
    result = generator.generate([PROMPT], max_new_tokens=16, seed=3, logprobs=2, speculate="draft", draft_len=3,
                                **CONTROLLED)
    assert result.accepted_tokens > 0
    tokens = result.tokens[0]
    scored = generator.score(PROMPT + tokens)[len(PROMPT) - 1:]
    assert [lp.token for lp in result.logprobs[0]] == tokens
    np.testing.assert_allclose([lp.logprob for lp in result.logprobs[0]], scored, atol=1e-4)
