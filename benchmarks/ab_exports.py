"""Two exports of one model, median ms per decode step, A/B.

    python benchmarks/ab_exports.py EXPORT_A EXPORT_B [ROUNDS]               # one process, generations alternating
    python benchmarks/ab_exports.py EXPORT_A EXPORT_B [ROUNDS] --processes   # one process per measurement

In one process the Generator created first runs slower (8-17%, whichever export it holds), so run
every one-process comparison in both orders and take the geometric mean of the two ratios.
`--processes` runs each measurement in its own process instead (benchmarks/step_medians.py's kvforge
worker: the median graph run of a 128-step greedy decode), alternating which export goes first, and
reports the median of the per-round ratios. Each process also draws its own speed mode on this shared
VM (benchmarks/README.md), which more rounds average out.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvforge.runtime import GenerationRequest, Generator


def in_one_process(a: str, b: str, rounds: int) -> None:
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


def in_processes(a: str, b: str, rounds: int) -> None:
    worker = Path(__file__).with_name("step_medians.py")
    ms: dict[str, list[float]] = {a: [], b: []}
    for i in range(rounds):
        for name in (a, b) if i % 2 == 0 else (b, a):
            out = subprocess.run([sys.executable, str(worker), name, "-", "--worker", "kvforge"],
                                 capture_output=True, text=True, check=True)
            ms[name].append(json.loads(out.stdout.strip().splitlines()[-1])["run_ms"])
        print(f"round {i + 1}: A {ms[a][-1]:.3f} ms, B {ms[b][-1]:.3f} ms (median graph run), A/B {ms[a][-1] / ms[b][-1]:.3f}",
              flush=True)
    ratios = [x / y for x, y in zip(ms[a], ms[b], strict=True)]
    print(f"A {a}: {statistics.median(ms[a]):.3f} ms  B {b}: {statistics.median(ms[b]):.3f} ms  median A/B time "
          f"ratio {statistics.median(ratios):.3f} ({sum(r > 1 for r in ratios)} of {len(ratios)} rounds B faster)")


if __name__ == "__main__":
    args = [arg for arg in sys.argv[1:] if arg != "--processes"]
    run = in_processes if "--processes" in sys.argv[1:] else in_one_process
    run(args[0], args[1], int(args[2]) if len(args) > 2 else 8)
