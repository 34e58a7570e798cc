"""Per-row cost of top-p filtering (runtime/controls/sampling.py): the candidate path against a full stable
argsort of the row (the implementation before it), temperature 0.7 + top_p 0.9 as `sample` does it,
on 49152-token rows. Rows: standard normal logits scaled by 1, 3 and 5, and with --export, the
logits of real decode steps (greedy, keep_logits) of that export. Both results are checked equal.
Also a whole `sample` call (temperature, filter, draw) with either filter. Minimum over repeats
(the machine is shared), milliseconds per row, median over the rows of a case.

    python benchmarks/bench_top_p.py --export kvforge-demo/smollm2-135m-instruct-ort
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvforge.runtime.controls import sampling
from kvforge.runtime.controls.sampling import SamplingConfig, _top_p_full, filter_logits

VOCAB = 49152


def _scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    # What sample() hands to filter_logits.
    logits64 = logits.astype(np.float64)
    return (logits64 - logits64.max(axis=-1, keepdims=True)) / temperature


def _best_ms(fn, row: np.ndarray, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(row)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", help="an export folder: also time rows of its real logits")
    parser.add_argument("--steps", type=int, default=24, help="decode steps of real logits")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    cases = {f"normal x{scale}": rng.standard_normal((1, VOCAB)) * scale for scale in (1, 3, 5)}
    if args.export:
        from kvforge.runtime import Generator

        gen = Generator(args.export, threads=2)
        prompt = gen.chat_ids("Write a short story about a lighthouse keeper.")
        result = gen.generate([prompt], max_new_tokens=args.steps, greedy=True, keep_logits=True)
        cases["real (all steps)"] = np.concatenate([step[:1] for step in result.logits])

    full = lambda row: _top_p_full(row, args.top_p)  # noqa: E731
    fast = lambda row: filter_logits(row, top_p=args.top_p)  # noqa: E731
    config = SamplingConfig(greedy=False, temperature=args.temperature, top_k=0, top_p=args.top_p)
    rng = np.random.default_rng(0)

    def sample_with(filter_fn):
        def run(row: np.ndarray) -> None:
            sampling.filter_logits = filter_fn
            try:
                sampling.sample(row, config, rng)
            finally:
                sampling.filter_logits = filter_logits
        return run

    sample_full = sample_with(lambda logits, top_k, top_p, min_p: _top_p_full(logits, top_p))
    sample_fast = sample_with(filter_logits)
    print(f"T={args.temperature} top_p={args.top_p}, V={VOCAB}, ms per row (min of {args.repeat})")
    print(f"{'logits':<18} {'kept':>6} | {'filter: full sort':>17} {'new':>6} {'x':>5} | "
          f"{'sample: before':>14} {'after':>6} {'x':>5}")
    for name, logits in cases.items():
        times: dict[str, list[float]] = {"full": [], "fast": [], "sample_full": [], "sample_fast": []}
        kept = []
        for raw, row in zip(logits, _scaled(logits, args.temperature), strict=True):
            row = row[None]
            assert np.array_equal(full(row), fast(row)), name
            kept.append(int(np.isfinite(fast(row)).sum()))
            times["full"].append(_best_ms(full, row, args.repeat))
            times["fast"].append(_best_ms(fast, row, args.repeat))
            times["sample_full"].append(_best_ms(sample_full, raw[None], args.repeat))
            times["sample_fast"].append(_best_ms(sample_fast, raw[None], args.repeat))
        t = {key: float(np.median(value)) for key, value in times.items()}
        print(f"{name:<18} {int(np.median(kept)):>6} | {t['full']:>17.2f} {t['fast']:>6.2f} "
              f"{t['full'] / t['fast']:>4.1f}x | {t['sample_full']:>14.2f} {t['sample_fast']:>6.2f} "
              f"{t['sample_full'] / t['sample_fast']:>4.1f}x")


if __name__ == "__main__":
    main()
