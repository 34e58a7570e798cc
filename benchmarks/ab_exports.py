"""Two exports of one model in one process, greedy generations alternating, median ms per decode step.

    python benchmarks/ab_exports.py EXPORT_A EXPORT_B [ROUNDS]

The Generator created first runs slower here (8-17%, whichever export it holds), so run every
comparison in both orders and take the geometric mean of the two ratios.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

from kvforge.runtime import GenerationRequest, Generator


def main(a: str, b: str, rounds: int) -> None:
    generators = {a: Generator(a, threads=2), b: Generator(b, threads=2)}
    prompt = [list(map(int, np.random.default_rng(0).integers(100, 1000, 128)))]
    request = GenerationRequest(prompt, 128, ignore_eos=True)
    first = {name: g.generate(request).tokens for name, g in generators.items()}
    if first[a] != first[b]:
        raise SystemExit("the two exports give different tokens")
    ms: dict[str, list[float]] = {a: [], b: []}
    for i in range(rounds):
        for name in (a, b) if i % 2 == 0 else (b, a):
            result = generators[name].generate(request)
            ms[name].append(result.decode_ms / result.steps)
    ratios = [x / y for x, y in zip(ms[a], ms[b], strict=True)]
    print(f"A {a}: {statistics.median(ms[a]):.3f} ms/step  B {b}: {statistics.median(ms[b]):.3f} ms/step  "
          f"A/B per round {', '.join(f'{r:.3f}' for r in ratios)}  median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
