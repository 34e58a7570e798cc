"""Which drafted tokens a verification keeps: the rule that leaves the output unchanged.

Greedy: a drafted token is kept while it equals the argmax of the target's (processed) logits at its
position; the first mismatch is replaced by that argmax. Sampling: the rejection rule of speculative
sampling (Leviathan et al. 2023, Chen et al. 2023): a token x drawn from the draft's distribution q is kept
with probability min(1, p(x) / q(x)), p being the target's distribution after temperature and top-k /
top-p / min-p; on rejection the replacement is drawn from norm(max(p - q, 0)). The kept tokens and the
replacement are then distributed exactly as the target's own samples. A draft chosen deterministically
(prompt lookup, or a greedy draft proposer) has q one-hot at x: kept with probability p(x), replaced by a
draw from p without x.
"""

from __future__ import annotations

import numpy as np

from kvforge.runtime.controls.sampling import SamplingConfig, filter_logits


def target_distribution(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The distribution `sampling.sample` draws from for one row of (processed) logits [V] -> [V] float64."""
    logits64 = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        scaled = (logits64 - logits64.max()) / config.temperature
    filtered = filter_logits(scaled[None], config.top_k, config.top_p, config.min_p)[0]
    weights = np.exp(filtered - filtered.max())
    return weights / weights.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from [V] probabilities by the same inverse-cdf draw as `sampling.sample` (u in (0, 1], so a
    zero-probability token is never drawn)."""
    cdf = np.cumsum(probs)
    u = (1.0 - rng.random()) * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="left"), len(cdf) - 1))


def keep_drafted(p: np.ndarray, token: int, q: np.ndarray | None, rng: np.random.Generator) -> bool:
    """Whether the rejection rule keeps drafted `token`: p the target's distribution at its position, q the
    draft's (None: the token was chosen deterministically, q one-hot)."""
    q_x = 1.0 if q is None else float(q[token])
    if q_x <= 0.0:  # the draft could not have drawn it; keep it only if the target is certain of it
        return bool(p[token] >= 1.0)
    return bool(rng.random() < min(1.0, float(p[token]) / q_x))


def replacement(p: np.ndarray, token: int, q: np.ndarray | None, rng: np.random.Generator) -> int:
    """The token drawn after `token` was rejected: from norm(max(p - q, 0)) (q one-hot at `token` when None)."""
    if q is None:
        residual = p.copy()
        residual[token] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if not total > 0.0:  # p == q to rounding: any draw from p is a draw from the residual's limit
        return draw(p, rng)
    return draw(residual / total, rng)
