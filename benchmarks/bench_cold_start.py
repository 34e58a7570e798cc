"""Cold start: `kvforge generate OUT --prompt TEXT --max-new-tokens 1` as whole processes against
onnxruntime-genai's equivalent (kvforge.tools.bench's cold worker: model, tokenizer, one token), alternating,
plus one fresh process's breakdown of kvforge's stages (run one after another there, so each is its own).

    python benchmarks/bench_cold_start.py OUT [--genai GENAI_MODEL_DIR] [--rounds 9] [--threads 2]

GENAI_MODEL_DIR: onnxruntime-genai's builder output for the same model (`kvforge bench OUT --compare
ort-genai` builds and caches one under ~/.cache/kvforge/bench). Wall time from spawn to exit, and the
process's CPU time (user + sys), which a busy shared host disturbs less.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from kvforge.tools.bench_workers import COLD_PROMPT, cold_start_command

STAGES = r"""
import sys, time
t0 = time.perf_counter()
import kvforge.cli  # what `kvforge generate` imports before it runs
from kvforge.runtime import Generator  # (the command's own import)
t1 = time.perf_counter()
from pathlib import Path
from kvforge.core.manifest import load_manifest, read_graph
from kvforge.runtime.backends.backend import create_backend
from kvforge.runtime.text.tokenizer import Tokenizer
folder, threads = Path(sys.argv[1]), int(sys.argv[2])
manifest = load_manifest(folder)
t2 = time.perf_counter()
Tokenizer(folder)
t3 = time.perf_counter()
read_graph(folder, manifest, "prefill")
t4 = time.perf_counter()
backend = create_backend("ort-cpu", folder, manifest, threads=threads)
t5 = time.perf_counter()
result = Generator(folder, backend=backend).generate([sys.argv[3]], max_new_tokens=1, greedy=True)
stages = {"imports": t1 - t0, "manifest checks (sha256 of files < 64 MiB)": t2 - t1, "tokenizer": t3 - t2,
          "graph read + sha256 (again inside the session's)": t4 - t3,
          "session creation (one: prefill graph serves decode)": t5 - t4, "first prefill (TTFT)": result.ttft_ms / 1e3}
print(__import__("json").dumps({k: round(v * 1e3, 1) for k, v in stages.items()}))
"""


def timed(command: list[str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one whole process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = (time.perf_counter() - start) * 1e3
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{command[:4]} failed: {proc.stderr.strip()[-400:]}")
    return wall, (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--genai", help="onnxruntime-genai's model folder for the same model")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default=COLD_PROMPT)
    args = parser.parse_args()
    systems = {"kvforge": cold_start_command("kvforge", args.export, args.prompt, args.threads)}
    if args.genai:
        systems["ort-genai"] = cold_start_command("ort-genai", args.genai, args.prompt, args.threads)
    python = timed([sys.executable, "-c", "pass"])
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, command in systems.items():  # alternating, round by round
            samples[name].append(timed(command))
        loads.append(os.getloadavg()[0])
    report = {name: {"wall_ms": statistics.median(w for w, _ in rows), "wall_ms_spread": [min(w for w, _ in rows),
                     max(w for w, _ in rows)], "cpu_ms": statistics.median(c for _, c in rows)}
              for name, rows in samples.items()}
    stages = subprocess.run([sys.executable, "-c", STAGES, args.export, str(args.threads), args.prompt],
                            capture_output=True, text=True, check=True)
    report["kvforge_stages_ms"] = {"interpreter start (python -c pass)": round(python[0], 1),
                                   **json.loads(stages.stdout.strip().splitlines()[-1])}
    report["load_average_1min"] = loads
    for name in systems:
        row = report[name]
        print(f"{name:<10} wall median {row['wall_ms']:6.0f} ms ({row['wall_ms_spread'][0]:.0f}-"
              f"{row['wall_ms_spread'][1]:.0f}), CPU {row['cpu_ms']:6.0f} ms")
    if "ort-genai" in report:
        print(f"kvforge / ort-genai: wall x{report['kvforge']['wall_ms'] / report['ort-genai']['wall_ms']:.2f}, "
              f"CPU x{report['kvforge']['cpu_ms'] / report['ort-genai']['cpu_ms']:.2f}")
    for stage, ms in report["kvforge_stages_ms"].items():
        print(f"  {stage:<52}{ms:8.1f} ms")
    print("load average (1 min) over the rounds:", " ".join(f"{x:.1f}" for x in loads))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
