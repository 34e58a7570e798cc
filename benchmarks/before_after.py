"""Decode tokens/s and time to first token of two copies of kvforge's code on one export, in
alternating processes (round by round, so a noisy host slows both alike): the Generator (batch 1)
and the serving Scheduler (4 requests together), each the median of 5 runs in a process. A refactor that must not slow anything down runs:

    python benchmarks/before_after.py EXPORT_DIR --before /path/to/old/code --rounds 6 [--json FILE]

`--before` is a folder holding the old `kvforge` package laid out as installed (it goes first on
PYTHONPATH); the current checkout is the "after". Ratios are after / before (>1: after is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS, SERVED, REPEAT = 128, 64, 4, 5  # REPEAT: runs per process, their median


def _measure(export_dir: str, threads: int) -> dict[str, float]:
    import kvforge
    from kvforge.runtime import GenerationRequest, Generator, SamplingConfig

    try:  # code from before runtime/ was grouped by role (the "before" of a comparison)
        from kvforge.runtime.scheduler import Scheduler
    except ImportError:
        from kvforge.runtime.drivers.scheduler import Scheduler

    prompt = [1 + (i * 37) % 500 for i in range(PROMPT_LEN)]
    gen = Generator(export_dir, threads=threads)
    gen.generate([prompt[:16]], max_new_tokens=4, greedy=True, ignore_eos=True)  # warm-up
    results = [gen.generate([prompt], max_new_tokens=NEW_TOKENS, greedy=True, ignore_eos=True) for _ in range(REPEAT)]
    scheduler = Scheduler(gen, max_batch=SERVED, max_seq_len=PROMPT_LEN + NEW_TOKENS + 8, prefill_chunk=128)
    scheduler.start()
    rates = []
    for _ in range(REPEAT):
        requests = [GenerationRequest([r + 2, *prompt[r:]], NEW_TOKENS, SamplingConfig(greedy=True),
                                      ignore_eos=True) for r in range(SERVED)]
        start = time.perf_counter()
        handles = [scheduler.submit(r) for r in requests]
        served = sum(len(h.result()[0]) for h in handles)
        rates.append(served / (time.perf_counter() - start))
    scheduler.close()
    return {"code": str(Path(kvforge.__file__).parent),
            "ttft_ms": statistics.median(r.ttft_ms for r in results),
            "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in results),
            "served_tokens_per_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir")
    parser.add_argument("--before", required=True, help="folder holding the old kvforge package")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for name in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
            env = dict(os.environ)
            if name == "before":
                env["PYTHONPATH"] = args.before + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, __file__, "--worker", args.export_dir, str(args.threads)],
                                 env=env, capture_output=True, text=True, check=True, cwd="/")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    assert runs["before"][0]["code"] != runs["after"][0]["code"], "both runs imported the same code"
    metrics = ("ttft_ms", "decode_tokens_per_s", "served_tokens_per_s")
    table = {name: {m: statistics.median(r[m] for r in rows) for m in metrics} for name, rows in runs.items()}
    table["ratio after/before"] = {m: table["after"][m] / table["before"][m] for m in metrics}
    for name, row in table.items():
        print(f"{name:20s} " + "  ".join(f"{m} {v:.3f}" for m, v in row.items()))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"export": args.export_dir, "rounds": args.rounds,
                                                    "medians": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        print(json.dumps(_measure(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
