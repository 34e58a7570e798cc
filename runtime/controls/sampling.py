"""Next-token selection on a [B, V] logits array: greedy, or temperature / top-k / top-p / min-p sampling.

numpy only (the runtime stands alone). Filtering follows Hugging Face's warpers so that a
generation_config.json means the same thing here: top-k keeps every token tied with the k-th,
top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one),
min-p keeps the tokens whose probability is at least min_p times the most likely one's.
The penalties (presence / frequency / repetition) need each row's token history and are applied
before this, per row, by runtime/controls/logit_controls.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.core.errors import InputError

# Hugging Face's GenerationConfig defaults, used when a generation dict leaves a key out.
HF_DEFAULT_TEMPERATURE = 1.0
HF_DEFAULT_TOP_K = 50
HF_DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. top_k=0, top_p=1.0 and min_p=0.0 disable those filters
    (applied in that order, after temperature, as Hugging Face does).

    Penalties (they apply under greedy decoding too: they change the argmax, as in Hugging Face):
    `presence_penalty` / `frequency_penalty` (OpenAI's: logit -= presence * (count > 0) +
    frequency * count, counting the tokens generated so far), `repetition_penalty` (Hugging
    Face's / CTRL's: the logit of every token of the prompt or generated so far is divided by it
    when positive, multiplied when negative; 1.0 disables it)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InputError(f"temperature must be a number > 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise InputError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not self.temperature > 0:
            raise InputError(
                f"temperature must be > 0, got {self.temperature}; for deterministic decoding ask for greedy "
                "(--greedy, greedy=True; temperature 0 over HTTP)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0
        ):
            raise InputError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise InputError(f"{name} must be in [-2, 2] (0 disables it), got {value!r}")
        if not _number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise InputError(
                f"repetition_penalty must be a number > 0 (1 disables it), got {self.repetition_penalty!r}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (each row then needs its token history)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_generation(cls, generation: dict[str, Any] | None) -> SamplingConfig:
        """Defaults from a generation_config.json-style dict (the manifest's "generation")."""
        generation = generation or {}
        if not generation.get("do_sample", False):
            # Greedy: the sampling keys are unused, and HF files sometimes hold values (temperature 0)
            # that would not validate; ignore them rather than refuse a valid export.
            return cls(greedy=True)
        return cls(
            greedy=False,
            temperature=float(generation.get("temperature") or HF_DEFAULT_TEMPERATURE),
            top_k=int(generation.get("top_k", HF_DEFAULT_TOP_K) or 0),
            top_p=float(generation.get("top_p", HF_DEFAULT_TOP_P) or HF_DEFAULT_TOP_P),
        )

    def with_overrides(self, **overrides: Any) -> SamplingConfig:
        """A copy with the non-None keyword arguments replaced (validated again)."""
        given = {key: value for key, value in overrides.items() if value is not None}
        return dataclasses.replace(self, **given)


def greedy(logits: np.ndarray) -> np.ndarray:
    """Argmax per row of [B, V] logits -> [B] int64."""
    # The method, not np.argmax: a step calls this once per token, and the dispatch costs a microsecond.
    return logits.argmax(axis=-1).astype(np.int64, copy=False)  # intp is int64 here: no copy


def filter_logits(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Return a copy of [B, V] logits (float32, or float64 if given) with the tokens outside
    top-k / top-p / min-p set to -inf."""
    out = np.array(logits, dtype=np.float64 if logits.dtype == np.float64 else np.float32, copy=True)
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(out, vocab - top_k, axis=-1)[:, vocab - top_k : vocab - top_k + 1]
        out[out < kth] = -np.inf
    if top_p < 1.0:
        _top_p(out, top_p)
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p): no softmax needed; the max stays.
        floor = out.max(axis=-1, keepdims=True) + np.log(min_p)
        out[out < floor] = -np.inf
    return out


# Top-p without sorting the whole row when it can be helped: a stable argsort of a 49152-token row
# costs ~6-10 ms, more than the rest of a sampling step. Three ways give the same result, cheapest first:
# the most likely TOP_P_CANDIDATES tokens (a real model's nucleus is usually far smaller), then a
# sort of the values only (no stable argsort), then the full stable argsort for what is left.
TOP_P_CANDIDATES = 1024


def _top_p(out: np.ndarray, top_p: float) -> None:
    """Top-p in place on [B, V] `out`, equal to `_top_p_full`."""
    rows = np.arange(out.shape[0])
    if out.shape[-1] > TOP_P_CANDIDATES:
        filtered, exact = _top_p_candidates(out, top_p, TOP_P_CANDIDATES)
        out[exact] = filtered[exact]
        rows = rows[~exact]
    if rows.size:
        filtered, exact = _top_p_sorted_values(out[rows], top_p)
        out[rows[exact]] = filtered[exact]
        rows = rows[~exact]
    if rows.size:
        out[rows] = _top_p_full(out[rows], top_p)


def _top_p_full(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p by a stable sort of the whole row (descending logit, ties by lower token index)."""
    out = logits.copy()
    order = np.argsort(-out, axis=-1, kind="stable")
    sorted_logits = np.take_along_axis(out, order, axis=-1)
    remove_sorted = _top_p_remove_sorted(sorted_logits, top_p)
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    out[remove] = -np.inf
    return out


def _top_p_remove_sorted(sorted_logits: np.ndarray, top_p: float) -> np.ndarray:
    """Which tokens of rows sorted by descending logit top-p removes."""
    probs = _softmax(sorted_logits)
    mass_before = np.cumsum(probs, axis=-1) - probs
    # Keep a token while the mass of the more likely ones has not reached top_p; the first always stays.
    remove_sorted = mass_before >= top_p
    remove_sorted[:, 0] = False
    return remove_sorted


def _top_p_sorted_values(logits: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-p from the sorted values alone -> (filtered [R, V], exact [R]). The sorted values are
    the full sort's, so its float operations are repeated exactly (same order, same sums); the
    kept tokens are then the first n of the stable order: those above the n-th value, and the
    lowest-index ones tied with it. Not `exact` in the rare rows where rounding makes the kept
    positions other than a prefix."""
    sorted_logits = -np.sort(-logits, axis=-1)
    remove_sorted = _top_p_remove_sorted(sorted_logits, top_p)
    exact = ~(remove_sorted[:, :-1] & ~remove_sorted[:, 1:]).any(axis=-1)
    count = logits.shape[-1] - remove_sorted.sum(axis=-1, keepdims=True)
    threshold = np.take_along_axis(sorted_logits, count - 1, axis=-1)
    above = logits > threshold
    tied = logits == threshold
    keep = above | (tied & (np.cumsum(tied, axis=-1) <= count - above.sum(axis=-1, keepdims=True)))
    keep |= count == logits.shape[-1]  # nothing removed (NaN rows included: the threshold is NaN)
    return np.where(keep, logits, -np.inf), exact


def _top_p_candidates(logits: np.ndarray, top_p: float, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-p on each row's `size` most likely tokens -> (filtered [R, V], exact [R]), with the
    probabilities normalised over the whole row as in the full sort. A row is `exact` when its
    result provably equals `_top_p_full`'s:
    - every keep/remove decision is at least `margin` away from top_p: the two computations differ
      only in the rounding of the row sum (another order) and of the cumulative sums, bounded by
      about (2 * size + 100) eps; the margin doubles that;
    - no token outside the candidates can enter the kept prefix: the kept tokens all lie strictly
      above the smallest candidate (an outside token at best ties with it, so it comes after them
      and after a removed candidate), or the smallest candidate is -inf (so is every outside token,
      and -inf stays -inf either way)."""
    vocab = logits.shape[-1]
    with np.errstate(invalid="ignore"):  # speculative: a row of NaN (all -inf) goes on to the next way
        # The full sort's order: descending value, ties by lower index (a stable sort of the
        # candidates taken in index order).
        cand = np.sort(np.argpartition(logits, vocab - size, axis=-1)[:, vocab - size:], axis=-1)
        values = np.take_along_axis(logits, cand, axis=-1)
        order = np.argsort(-values, axis=-1, kind="stable")
        cand = np.take_along_axis(cand, order, axis=-1)
        values = np.take_along_axis(values, order, axis=-1)
        exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = np.take_along_axis(exp, cand, axis=-1) / exp.sum(axis=-1, keepdims=True)
        mass_before = np.cumsum(probs, axis=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False

        margin = np.finfo(logits.dtype).eps * (4 * size + 1024)
        clear = (mass_before >= top_p + margin) | (mass_before < top_p - margin) | ~(values > -np.inf)
        clear[:, 0] = True
        smallest = values[:, -1]
        smallest_kept = np.where(remove_sorted, np.inf, values).min(axis=-1)
        exact = clear.all(axis=-1) & ((smallest == -np.inf) | (smallest_kept > smallest))

    filtered = np.full_like(logits, -np.inf)
    np.put_along_axis(filtered, cand, np.where(remove_sorted, -np.inf, values), axis=-1)
    return filtered, exact


def sample(logits: np.ndarray, config: SamplingConfig,
           rng: np.random.Generator | Sequence[np.random.Generator]) -> np.ndarray:
    """Pick one token per row of [B, V] logits according to `config` -> [B] int64. `rng`: one
    generator for the whole batch, or one per row (each row then draws from its own stream)."""
    if config.greedy:
        return greedy(logits)
    # Shift by the row max before dividing, in float64: a tiny temperature then sends every other
    # logit towards -inf (the greedy limit) instead of overflowing to inf and NaN.
    logits64 = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        scaled = (logits64 - logits64.max(axis=-1, keepdims=True)) / config.temperature
    probs = _softmax(filter_logits(scaled, config.top_k, config.top_p, config.min_p))
    cdf = np.cumsum(probs, axis=-1)
    # u in (0, 1]: the chosen index i satisfies cdf[i-1] < u*total <= cdf[i], so zero-probability
    # tokens (flat cdf) can never be drawn.
    if isinstance(rng, np.random.Generator):
        draws = rng.random(cdf.shape[0])
    else:
        draws = np.array([row_rng.random() for row_rng in rng])
    u = (1.0 - draws) * cdf[:, -1]
    picks = (cdf < u[:, None]).sum(axis=-1)
    return np.minimum(picks, cdf.shape[-1] - 1).astype(np.int64)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with n > 1 choices: seed + index, so that choice 0
    draws exactly like a lone request with `seed` and choice i like one with seed + i (None stays
    None: fresh entropy per choice)."""
    return None if seed is None else seed + index


class Sampler:
    """A SamplingConfig with its own random generator, so a seed reproduces a whole generation.
    `row_seeds`: one generator per row instead (rows of n > 1 choices, see choice_seed)."""

    def __init__(self, config: SamplingConfig, row_seeds: Sequence[int | None] | None = None) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        self.row_rngs = [np.random.default_rng(seed) for seed in row_seeds] if row_seeds is not None else None

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        return sample(logits, self.config, self.row_rngs if self.row_rngs is not None else self.rng)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)
