"""Real sizes on a lent GPU (issue 42): the 1B and 8B Llama shapes made, exported and timed on the GPU machine.

    python benchmarks/gpu_real_sizes.py --out $OUT --work /tmp/real [--sizes llama-3.2-1b,llama-3.1-8b] [--budget-s 780]
    python benchmarks/gpu_real_sizes.py --out /tmp/o --work /tmp/w --sizes smollm2-135m --backend ort-cpu  # CPU rehearsal

The GPU machine has 128 GB and 16 cores, so the checkpoints are written there (benchmarks/make_real_shape.py,
seeded random fp16 weights with the real shapes) and only kvforge and its kit travel. For each size, in order:

  make       the checkpoint: seconds and peak RSS
  export     `kvforge export --dtype fp16` and `--quantize int4 --dtype fp16` (MatMulNBits with fp16
             activations, ONNX Runtime CUDA's form): seconds and peak RSS of each
  parity     `kvforge parity --backend ort-cuda` of the int4 fp16 export against Hugging Face fp16 (the int4
             gate: perplexity) and of the fp16 export (logits), on the smallest size only
  bench      `kvforge bench --backend ort-cuda --batch 1,8,32 --compare hf-compiled --json` for both exports,
             then batch 1 at a 2,048-token prompt: decode tokens/s with its share of the bandwidth limit

Every step is timed and caught (a failure is recorded and the next runs), the results land in
OUT/real_sizes.json as they come, and steps are skipped once --budget-s is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Run:
    def __init__(self, out: Path, work: Path, budget: float, backend: str) -> None:
        self.out, self.work, self.budget, self.backend = out, work, budget, backend
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {"backend": backend}
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def save(self) -> None:
        (self.out / "real_sizes.json").write_text(json.dumps(self.results, indent=2))

    def step(self, name: str, command: list[str], timeout: float | None = None) -> dict[str, Any]:
        """Run one command under its own peak-RSS probe; record seconds, peak GB, exit code and its tail."""
        if self.left() < 30:
            record: dict[str, Any] = {"skipped": f"the budget ({self.budget:.0f} s) is spent"}
        else:
            probe = [sys.executable, str(HERE / "gpu_real_sizes.py"), "--peak-of", "--", *command]
            started = time.perf_counter()
            try:
                done = subprocess.run(probe, capture_output=True, text=True, timeout=min(timeout or 1e9, self.left()))
                record = {"seconds": round(time.perf_counter() - started, 1), "rc": done.returncode,
                          "tail": (done.stdout + done.stderr)[-1500:]}
                peak = [line for line in done.stderr.splitlines() if line.startswith("PEAK_RSS_BYTES ")]
                if peak:
                    record["peak_rss_gb"] = round(int(peak[-1].split()[1]) / 1e9, 2)
            except subprocess.TimeoutExpired:
                record = {"timed_out_s": round(time.perf_counter() - started, 1)}
        self.results[name] = record
        self.save()
        print(f"{name}: {({k: v for k, v in record.items() if k != 'tail'})}", flush=True)
        return record


def peak_of(command: list[str]) -> int:
    """Run `command`, then print its peak RSS (the children's ru_maxrss, which is per process: the command's own)."""
    import resource

    code = subprocess.call(command)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"PEAK_RSS_BYTES {peak}", file=sys.stderr)
    return code


def one_size(run: Run, size: str, first: bool) -> None:
    kvforge = ["kvforge"]
    source = run.work / size
    if not (source / "config.json").is_file():
        run.step(f"{size}/make", [sys.executable, str(HERE / "make_real_shape.py"), size, str(source), "--force"])
    exports = {"fp16": ["--dtype", "fp16"], "int4-fp16": ["--quantize", "int4", "--quant-method", "rtn", "--dtype", "fp16", "--no-accuracy-check"]}
    for name, options in exports.items():
        folder = run.work / f"{size}-{name}"
        run.step(f"{size}/export-{name}", [*kvforge, "export", str(source), "-o", str(folder), "--force", *options])
    if first:
        for name in exports:
            run.step(f"{size}/parity-{name}", [*kvforge, "parity", str(source), str(run.work / f"{size}-{name}"),
                                               "--backend", run.backend, "--new-tokens", "16", "--json"])
    batches = "1,8,32" if run.backend != "ort-cpu" else "1"
    for name in exports:
        folder = str(run.work / f"{size}-{name}")
        gpu = ["--backend", run.backend] if run.backend != "ort-cpu" else ["--no-cold-start"]
        peers = ["--compare", "hf-compiled"] if run.backend != "ort-cpu" else []  # HF + torch.compile, the same GPU
        run.step(f"{size}/bench-{name}", [*kvforge, "bench", folder, *gpu, *peers, "--batch", batches, "--prompt-len", "128",
                                          "--new-tokens", "128", "--repeat", "3", "--json"])
        run.step(f"{size}/bench-{name}-2048", [*kvforge, "bench", folder, *gpu, "--batch", "1", "--prompt-len", "2048",
                                               "--new-tokens", "64", "--repeat", "3", "--json"])


def main() -> None:
    if "--peak-of" in sys.argv:
        sys.exit(peak_of(sys.argv[sys.argv.index("--") + 1:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "real-sizes-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvforge-real-sizes"))
    parser.add_argument("--sizes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--budget-s", type=float, default=780.0)
    parser.add_argument("--backend", default="ort-cuda", choices=["ort-cuda", "ort-cpu"])
    args = parser.parse_args()
    run = Run(args.out, args.work, args.budget_s, args.backend)
    if args.backend == "ort-cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        run.results["gpu"] = smi.stdout.strip()
    for index, size in enumerate(args.sizes.split(",")):
        one_size(run, size, first=index == 0)
    run.results["total_s"] = round(time.perf_counter() - run.started, 1)
    run.save()


if __name__ == "__main__":
    main()
