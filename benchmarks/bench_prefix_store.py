"""The prefix store's cost per lookup and per store as it fills (issue 43, 2): the scheduler thread runs
both for every request, so they must not grow with the number of entries.

Two workloads, each at 100, 1,000, 10,000 and 100,000 entries:
- distinct: short prompts (3 tokens) with nothing in common, as the hostile probe sent;
- chat: a 40-token system prompt shared by every entry, then 8-200 tokens of its own.
Each size fills a fresh store, then times --ops lookups of prompts that continue a random entry (hits),
--ops lookups of prompts that share no token with any entry (misses: their tokens are drawn from another
range), and --ops stores of new prompts, each evicting the oldest entry. The work per operation is then
the same at every size, and what grows with the entries shows. Microseconds per call (the best of 5 passes), with each size's
ratio to the 100-entry one; each figure the median of three stores filled with different seeds.

    python benchmarks/bench_prefix_store.py --out benchmarks/results/prefix_store.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.prefix_store import PrefixStore  # noqa: E402

SIZES = (100, 1_000, 10_000, 100_000)
OPS = ("hit", "miss", "store")
KV = [(np.zeros(1, np.float32),)]  # the rows' size does not enter the index; the entry count does


def _prompts(kind: str, n: int, rng: np.random.Generator, low: int = 0) -> list[list[int]]:
    high = low + 50_000
    if kind == "distinct":
        return rng.integers(low, high, size=(n, 3)).tolist()
    system = rng.integers(low, high, size=40).tolist()
    return [system + rng.integers(low, high, size=int(rng.integers(8, 200))).tolist() for _ in range(n)]


def _us_per_call(fn, items, repeats: int = 5) -> float:
    """The best of `repeats` passes over `items`, per call: one clock read a pass, not one a call."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - began) / len(items))
    return best * 1e6


def measure(kind: str, size: int, ops: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    entries = _prompts(kind, size, rng)
    store = PrefixStore(1 << 40, max_entries=size)
    for tokens in entries:
        store.store(tokens, KV)
    picks = rng.integers(0, size, size=ops)
    fresh = _prompts(kind, ops, rng)
    hits = [entries[i] + fresh[j][-5:] for j, i in enumerate(picks)]
    misses = _prompts(kind, ops, rng, low=50_000)
    hit = _us_per_call(store.lookup, hits)
    miss = _us_per_call(store.lookup, misses)
    stored = _us_per_call(lambda tokens: store.store(tokens, KV), fresh, repeats=1)  # each evicts the oldest
    return {"workload": kind, "entries": size, "hit_us": round(hit, 2), "miss_us": round(miss, 2),
            "store_us": round(stored, 2), "held": len(store)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="lookups and stores timed per size")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for kind in ("distinct", "chat"):
        for size in SIZES:
            # Three fresh stores a size, each field their median: one pass is at the mercy of a noisy host.
            runs = [measure(kind, size, args.ops, seed) for seed in range(3)]
            row = {key: statistics.median(run[key] for run in runs) if key.endswith("_us") else value
                   for key, value in runs[0].items()}
            base = next(r for r in rows + [row] if r["workload"] == kind and r["entries"] == SIZES[0])
            for op in OPS:
                row[f"{op}_ratio"] = round(row[f"{op}_us"] / base[f"{op}_us"], 2)
            rows.append(row)
            print(f"{kind:9} {size:>7,} entries: " + ", ".join(
                f"{op} {row[f'{op}_us']:5.1f} us ({row[f'{op}_ratio']:.2f}x)" for op in OPS), flush=True)
    worst = max(r[f"{op}_ratio"] for r in rows for op in OPS)
    print(f"largest ratio to 100 entries: {worst:.2f}x (flat means within 2x)")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "largest_ratio": worst}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
