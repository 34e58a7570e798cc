"""Per-round kvforge / onnxruntime-genai decode ratios of `kvforge bench --compare ort-genai --json`
outputs: the median with a 95% bootstrap interval, the geometric mean and how many rounds kvforge won.

    python benchmarks/paired_ratios.py run1.json [run2.json ...]
"""

from __future__ import annotations

import json
import sys

import numpy as np


def summarise(path: str) -> str:
    raw = json.load(open(path))["raw"]
    ours = np.array([r["decode_tokens_per_s"] for r in raw["kvforge"]])
    theirs = np.array([r["decode_tokens_per_s"] for r in raw["ort-genai"]])
    ratios = ours / theirs  # round i of each ran back to back, so the pairs share the machine's state
    medians = np.median(np.random.default_rng(0).choice(ratios, (10000, len(ratios))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return (f"{path}: {len(ratios)} paired rounds, median ratio {np.median(ratios):.3f} (95% bootstrap CI "
            f"{low:.3f}-{high:.3f}), geo-mean {np.exp(np.log(ratios).mean()):.3f}, kvforge ahead in "
            f"{int((ratios > 1).sum())}/{len(ratios)}; rounds {' '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(summarise(argument))
