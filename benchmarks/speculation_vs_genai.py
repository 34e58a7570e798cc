"""kvforge's draft-model speculation against onnxruntime-genai's, same model, same machine, one process.

The real SmolLM2-135M-Instruct: kvforge's fp32 export with its int4 export drafting, against onnxruntime-genai's
fp32 model alone and with its own draft-model speculation (its builder's int4 model drafting, its
`model.draft` config: benchmarks/genai_speculative_peer.py). Every system takes its turn prompt by prompt, round
by round (machine noise hits all alike); batch 1, greedy, exactly --new-tokens tokens, 2 threads each, the same
prompt ids (kvforge's chat template over four questions whose answers do not repeat themselves). Reported:
median decode tokens/s (prefill and first token excluded, as both libraries count), the median of the ratios
paired by (prompt, round) to kvforge's plain fp32 and to onnxruntime-genai's plain fp32, acceptance and tokens
per target step, and whether every run gave plain greedy's tokens.

    PYTHONPATH=/path/with/onnxruntime_genai OMP_NUM_THREADS=2 python benchmarks/speculation_vs_genai.py \\
        --source smollm2.hf --target fp32-export --draft int4-export --k 2 3 4 --repeat 3 --json out.json

onnxruntime-genai (`pip install onnxruntime-genai`, 0.18.0 measured) is the bench extra's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from genai_speculative_peer import QUESTIONS, generate, load, speculative_folder  # noqa: E402


def _kvforge(generator: Any, ids: list[int], new_tokens: int, k: int | None) -> dict[str, Any]:
    options = {"speculate": "draft", "draft_len": k} if k else {}
    result = generator.generate([ids], max_new_tokens=new_tokens, greedy=True, ignore_eos=True, **options)
    row = {"decode_tokens_per_s": result.decode_tokens_per_s, "tokens": result.tokens[0]}
    if k:
        row["acceptance_rate"] = result.accepted_tokens / max(1, result.draft_tokens)
        row["tokens_per_target_pass"] = result.tokens_per_step
    return row


def _summary(samples: list[dict[str, Any]], plain: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    speeds = [s["decode_tokens_per_s"] for s in samples]
    out = {"decode_tokens_per_s": statistics.median(speeds), "spread": [min(speeds), max(speeds)]}
    for name, base in plain.items():
        out[f"ratio_over_{name}"] = statistics.median(
            s["decode_tokens_per_s"] / b["decode_tokens_per_s"] for s, b in zip(samples, base, strict=True))
    for key in ("acceptance_rate", "tokens_per_target_pass"):
        if key in samples[0]:
            out[key] = statistics.median(s[key] for s in samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="the Hugging Face folder of both exports")
    parser.add_argument("--target", type=Path, required=True, help="kvforge's fp32 export")
    parser.add_argument("--draft", type=Path, required=True, help="kvforge's int4 export (the draft)")
    parser.add_argument("--k", type=int, nargs="+", default=[3])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import onnxruntime_genai as og

    from kvforge.runtime import Generator
    from kvforge.tools.bench import _genai_model

    load_before = os.getloadavg()
    plain_ours = Generator(args.target, threads=args.threads)  # each loaded as a user loads it: with a draft,
    ours = Generator(args.target, threads=args.threads, draft=args.draft)  # the target's threads do not spin
    folders = {p: _genai_model(args.source, p, print) for p in ("fp32", "int4")}
    peer = load(folders["fp32"], args.threads)
    peer_spec = {k: load(speculative_folder(folders["fp32"], folders["int4"], k), args.threads) for k in args.k}
    prompts = [ours.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    systems: dict[str, Any] = {"kvforge fp32": lambda ids: _kvforge(plain_ours, ids, args.new_tokens, None),
                               "ort-genai fp32": lambda ids: generate(peer, ids, args.new_tokens, None)}
    for k in args.k:
        systems[f"kvforge fp32 + int4 draft, k={k}"] = lambda ids, k=k: _kvforge(ours, ids, args.new_tokens, k)
        systems[f"ort-genai fp32 + int4 draft, k={k}"] = lambda ids, k=k: generate(
            peer_spec[k], ids, args.new_tokens, {"max_draft_tokens": k})
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    reference: dict[int, list[int]] = {}
    started = time.perf_counter()
    for round_ in range(args.repeat):
        for p, ids in enumerate(prompts):
            for name, run in systems.items():
                row = run(ids)
                reference.setdefault(p, row["tokens"])
                row["same_tokens"] = row.pop("tokens") == reference[p]
                samples[name].append(row)
        print(f"round {round_ + 1}/{args.repeat} done", flush=True)
    plain = {"kvforge_fp32": samples["kvforge fp32"], "ort_genai_fp32": samples["ort-genai fp32"]}
    table = {name: {**_summary(rows, plain), "same_tokens": all(r["same_tokens"] for r in rows)}
             for name, rows in samples.items()}
    report = {"onnxruntime_genai": og.__version__, "source": str(args.source), "target": str(args.target),
              "draft": str(args.draft), "threads": args.threads, "new_tokens": args.new_tokens,
              "repeat": args.repeat, "prompts": len(prompts), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "seconds": time.perf_counter() - started, "systems": table}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
