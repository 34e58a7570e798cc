"""Exports at real sizes on this machine: kvforge and onnxruntime-genai's model builder on the same folders,
time and peak RSS of each, one after the other (issue 42; docs/benchmarks.md "Real sizes").

    python benchmarks/make_real_shape.py llama-3.2-1b /data/llama1b          # the checkpoints, once
    python benchmarks/real_sizes.py /data/smollm2 /data/llama1b /data/llama8b --work /data/exports \\
        --out benchmarks/results/real_sizes.json [--cap-gb 19] [--systems kvforge,builder] [--kinds fp16,int4]

Each run is `/usr/bin/time -v` of a whole process (peak RSS is its own), inside a cgroup-v1 memory cap
where one can be made (root), so a run that would take the machine down is killed instead and recorded as
such. kvforge: `kvforge export --dtype fp16` and `--quantize int4 --no-accuracy-check` (int4 with fp32
activations, the CPU form; its accuracy check is a separate measurement). The builder:
`python -m onnxruntime_genai.models.builder -p fp16 -e cuda` (its fp16 form; its CPU fp16 is not offered)
and `-p int4 -e cpu`. Figures are for one quiet-ish shared machine: read them as ratios within a row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CGROUP = Path("/sys/fs/cgroup/memory/kvforge-real-sizes")


def _cap(gb: float | None) -> list[str]:
    """A cgroup-v1 memory cap for the runs (a shell prefix that joins it), or none where it cannot be made."""
    if gb is None:
        return []
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(int(gb * 2**30)))
    except OSError as err:
        print(f"no memory cap ({err}); runs are not capped", file=sys.stderr)
        return []
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "capped"]


def timed(command: list[str], cap: list[str]) -> dict[str, Any]:
    """Seconds, peak RSS (GB) and the outcome of one whole process."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *cap, *command], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    killed = "Command terminated by signal 9" in done.stderr
    record = {"seconds": round(seconds, 1), "peak_rss_gb": round(int(peak.group(1)) / 2**20, 2) if peak else None,
              "rc": done.returncode}
    if killed:
        record["outcome"] = "killed (memory cap)"
    elif done.returncode:
        record["outcome"] = "failed: " + (done.stderr.strip().splitlines() or ["?"])[-12][-300:]
    else:
        record["outcome"] = "ok"
    return record


def commands(system: str, kind: str, model: Path, out: Path) -> list[str]:
    if system == "kvforge":
        options = ["--dtype", "fp16"] if kind == "fp16" else ["--quantize", "int4", "--quant-method", "rtn", "--no-accuracy-check"]
        return ["kvforge", "export", str(model), "-o", str(out), "--force", *options]
    precision, device = ("fp16", "cuda") if kind == "fp16" else ("int4", "cpu")
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model), "-o", str(out),
            "-p", precision, "-e", device, "-c", str(out) + ".cache"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cap-gb", type=float, default=19.0)
    parser.add_argument("--systems", default="kvforge,builder")
    parser.add_argument("--kinds", default="fp16,int4")
    parser.add_argument("--keep", action="store_true", help="keep kvforge's exports (default: every output is deleted after its run)")
    args = parser.parse_args()
    cap = _cap(args.cap_gb) if os.geteuid() == 0 else []
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for model in args.models:
        weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        row = results.setdefault(model.name, {"weights_gb": round(weights / 1e9, 2)})
        for kind in args.kinds.split(","):
            for system in args.systems.split(","):
                out = args.work / f"{model.name}-{system}-{kind}"
                record = timed(commands(system, kind, model, out), cap)
                if system == "kvforge" and record["outcome"] == "ok":  # where its time went (manifest laps)
                    laps = json.loads((out / "kvforge.json").read_text())["export_seconds"]
                    record["laps"] = {name: round(value, 1) for name, value in laps.items()}
                row[f"{system}/{kind}"] = record
                print(model.name, system, kind, record, flush=True)
                args.out.write_text(json.dumps(results, indent=2))
                if not args.keep or system != "kvforge":
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(str(out) + ".cache", ignore_errors=True)


if __name__ == "__main__":
    main()
