"""What an EAGLE-3 head costs per drafted token, as a share of one target decode step, at the Llama-3.2-1B shape
on this CPU (issue 54 asks for <= 15%).

Random weights throughout (a step's cost does not depend on the values): the target is benchmarks/make_real_shape.py's
llama-3.2-1b checkpoint (fp16 on disk, exported fp32), the head a seeded random EAGLE-3 head in speculators' form
(models/eagle3_checkpoint.py) shaped like the published yuhuili/EAGLE3-LLaMA3.1-Instruct-8B head at 1B size: one
Llama layer with the target's heads (32 / 8 KV of 64) and MLP width (8192), draft vocabulary 32000, aux layers
[2, 8, 13]. Both are made in --work where missing, then exported for ONNX Runtime with and without the head, each
export under /usr/bin/time -v (its peak RSS) inside a memory cap (a cgroup-v1 group where one can be made, else
`ulimit -v`).

The timing runs in this process, which imports neither torch nor the exporter: kvforge's runtime as it runs the
target (LoadedExport(...).backend: allocate / prefill / decode, KV bound in place; its default "single" session,
in which the prefill graph serves the S=1 decode step) and the head (runtime/backends/head_runner.py HeadRunner:
its own KV cache bound in place). A 16-token prompt is prefilled, then every call runs at --context cached
positions (the lengths are reset before each call; attention's cost depends on the length, not the values). One
round times each call once, so machine noise falls on all alike; the figures are medians over
--runs rounds, and the shares are also given as medians of each round's own ratio (steadier on a shared machine). A
round runs the calls back to back (--gap-ms of idle time between them) in a speculation loop's order (loop_order):
the head's calls follow the target's step, its catch-up first, then a drafted token.
By default it times twice, ONNX Runtime's intra-op threads spinning between ops (the runtime's default) and
sleeping (spinning=False), one after the other: with three sessions taking turns on a few shared cores, an idle
session's spinning threads take CPU from the running one.

    python benchmarks/eagle3_head_cost.py --work /tmp/eagle3-1b --json benchmarks/results/eagle3_head_cost_1b.json

Shares: head_step_share = one head call with S=1 (a drafted token) / one target decode step of the export with the
head; target_hidden_cost = the with-head target's decode step / the plain export's; catch_up_share[S] = the head's
call over S positions (after a verification) / the target step. weights_share is the bytes each step reads,
head / target (a decode step at batch 1 is bound by them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPE = "llama-3.2-1b"
HEAD = dict(form="speculators", draft_vocab_size=32000, heads=32, kv_heads=8, intermediate_size=8192, scale=0.02,
            seed=0)
CGROUP = Path("/sys/fs/cgroup/memory/kvforge-eagle3-head-cost")
PROMPT = 16  # tokens prefilled for real before the lengths are set to --context


def memory_cap(gb: float) -> tuple[list[str], str]:
    """A shell prefix that runs a command inside a `gb` memory cap, and how it is capped: a cgroup-v1 group (root),
    else `ulimit -v` (address space, which over-counts: a fallback)."""
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(int(gb * 2**30)))
        return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "capped"], f"cgroup-v1 {gb} GB"
    except OSError:
        return ["sh", "-c", f'ulimit -v {int(gb * 2**20)} && exec "$@"', "capped"], f"ulimit -v {gb} GB"


def timed(command: list[str], cap: list[str], log: Path) -> dict[str, Any]:
    """Seconds, peak RSS (GB) and outcome of one whole process (its output kept in `log`)."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *cap, *command], capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    record = {"command": " ".join(command), "seconds": round(time.perf_counter() - started, 1),
              "peak_rss_gb": round(int(peak.group(1)) / 2**20, 2) if peak else None, "rc": done.returncode}
    if "Command terminated by signal 9" in done.stderr:
        record["outcome"] = "killed (memory cap)"
    elif done.returncode:
        record["outcome"] = "failed: " + " | ".join(done.stderr.strip().splitlines()[-25:-20])[-400:]
    else:
        record["outcome"] = "ok"
    return record


def kvforge_command() -> list[str]:
    """The kvforge CLI of this interpreter's environment (its script where installed, else the module)."""
    python = sys.executable
    return [python, "-m", "kvforge.cli"] if not Path(python).with_name("kvforge").exists() \
        else [str(Path(python).with_name("kvforge"))]


def prepare(work: Path, cap_gb: float) -> dict[str, Any]:
    """The checkpoint, the head and both exports in `work`, each made only where missing; the records of the steps
    (this run's, or the run's that made them, kept in work/prepare.json)."""
    python, kvforge = sys.executable, kvforge_command()
    ckpt, head = work / "llama-1b", work / "head"
    steps = [
        ("checkpoint", ckpt / "config.json", [python, str(HERE / "make_real_shape.py"), SHAPE, str(ckpt)]),
        ("head", head / "config.json", [python, "-c", "import sys; from kvforge.models.eagle3_checkpoint import "
                                        f"write_random_head as w; w(sys.argv[1], sys.argv[2], **{HEAD!r})",
                                        str(ckpt), str(head)]),
        ("export_with_head", work / "ort-eagle" / "kvforge.json",
         [*kvforge, "export", str(ckpt), "-o", str(work / "ort-eagle"), "--target", "ort", "--eagle", str(head),
          "--force"]),
        ("export_plain", work / "ort-plain" / "kvforge.json",
         [*kvforge, "export", str(ckpt), "-o", str(work / "ort-plain"), "--target", "ort", "--force"]),
    ]
    return run_steps(work, steps, cap_gb)


def run_steps(work: Path, steps: list[tuple[str, Path, list[str]]], cap_gb: float) -> dict[str, Any]:
    """Run each (name, marker, command) whose marker file is missing, timed inside the memory cap; the records
    (kept in work/prepare.json across runs). Shared with benchmarks/mtp_head_cost.py."""
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "prepare.json"
    records: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    cap, how = memory_cap(cap_gb)
    for name, marker, command in steps:
        if marker.exists():
            records.setdefault(name, {"outcome": "made earlier (no record)"})
            continue
        print(f"making {name}: {' '.join(command)}", file=sys.stderr, flush=True)
        records[name] = {**timed(command, cap, work / f"{name}.log"), "memory_cap": how}
        saved.write_text(json.dumps(records, indent=1))
        if records[name]["outcome"] != "ok":
            raise SystemExit(f"{name} failed ({records[name]['outcome']}); see {work / (name + '.log')}")
    return records


def weights_share(ckpt: Path, head: Path) -> dict[str, Any]:
    """Weight elements each step reads (batch 1: one row of each embedding), head / target."""
    t = json.loads((ckpt / "config.json").read_text())
    h = json.loads((head / "config.json").read_text())
    layer = h["transformer_layer_config"]
    hid, heads, kv, dim = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    per_layer = hid * (heads + 2 * kv) * dim + heads * dim * hid + 3 * hid * t["intermediate_size"]
    target = t["num_hidden_layers"] * per_layer + t["vocab_size"] * hid  # tied: the lm_head is the embedding
    hh, hq, hk, hd = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    n_aux = len(h["eagle_aux_hidden_state_layer_ids"])
    head_elems = (n_aux * hid * hh + 2 * hh * (hq + 2 * hk) * hd + hq * hd * hh + 3 * hh * layer["intermediate_size"]
                  + h["draft_vocab_size"] * hh)
    return {"target_weight_elements": target, "head_weight_elements": head_elems, "share": head_elems / target}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _load() -> str:
    with open("/proc/loadavg") as file:
        return file.read().strip()


def loop_order(round_: int, catch_up: list[int]) -> list[str]:
    """One round's calls in a speculation loop's order: the two targets' steps (which goes first alternates), then
    the head's catch-up calls (which goes first rotates: the first head call after a target step is the catch-up,
    and pays for waking the head session's threads), then a drafted token, which follows a head call."""
    targets = ["target_with_head", "target_plain"][:: 1 if round_ % 2 else -1]
    turn = round_ % len(catch_up) if catch_up else 0
    ups = [f"head_s{s}" for s in catch_up[turn:] + catch_up[:turn]]
    return [*targets, *ups, "head_s1"]


def measure(work: Path, context: int, runs: int, threads: int, catch_up: list[int], spinning: bool = True,
            gap_s: float = 0.0, warmup: int = 3, folders: tuple[str, str] = ("ort-eagle", "ort-plain")
            ) -> dict[str, Any]:
    """The alternating timing (module docstring): per call, the median ms and every sample. `folders`: the
    exports (in `work`) with the head and without it."""
    import numpy as np

    from kvforge.runtime.backends.head_runner import HeadRunner
    from kvforge.runtime.drivers.loaded_export import LoadedExport

    capacity = context + max([1, *catch_up]) + 8
    exports = {"with_head": LoadedExport(work / folders[0], threads=threads, spinning=spinning),
               "plain": LoadedExport(work / folders[1], threads=threads, spinning=spinning)}
    runner = HeadRunner(work / folders[0], exports["with_head"].manifest, threads=threads, spinning=spinning)
    prompt = np.arange(100, 100 + PROMPT, dtype=np.int64)[None]
    slots = {}
    for name, export in exports.items():
        slots[name] = export.backend.allocate(1, capacity)
        export.backend.prefill(slots[name], prompt, np.array([[PROMPT - 1]]))
    hidden = exports["with_head"].backend.target_hidden(slots["with_head"])  # [1, PROMPT, Dt]: the real path
    head_slot = runner.allocate(1, capacity)
    _, draft_hidden = runner.run(head_slot, prompt, hidden, np.zeros((1, PROMPT, runner.width), np.float32),
                                 np.zeros(1, np.int32))
    token = np.array([42], dtype=np.int64)
    lens = np.array([context], np.int32)
    calls = {}
    for name, export in exports.items():
        def target_step(export: Any = export, slot: Any = slots[name]) -> float:
            slot.cache.past_lens[:] = context
            start = time.perf_counter()
            export.backend.decode(slot, token)
            return time.perf_counter() - start
        calls[f"target_{name}"] = target_step
    rng = np.random.default_rng(0)
    for s in [1, *catch_up]:
        ids = rng.integers(100, 30000, size=(1, s), dtype=np.int64)
        # S=1 is a drafted token: no target state (zeros), the head's own last hidden_out fed back.
        target_in = np.zeros((1, s, runner.target_width), np.float32) if s == 1 \
            else rng.standard_normal((1, s, runner.target_width), dtype=np.float32)
        draft_in = np.repeat(draft_hidden[:, -1:], s, axis=1) if s == 1 else np.zeros((1, s, runner.width), np.float32)

        def head_step(ids: Any = ids, target_in: Any = target_in, draft_in: Any = draft_in) -> float:
            start = time.perf_counter()
            runner.run(head_slot, ids, target_in, draft_in, lens)
            return time.perf_counter() - start
        calls[f"head_s{s}"] = head_step
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    load_before, started = _load(), time.perf_counter()
    for round_ in range(runs):
        for name in loop_order(round_, catch_up):
            time.sleep(gap_s)  # the last call's session's threads stop spinning before this one is timed
            samples[name].append(calls[name]() * 1e3)
    return {"samples_ms": samples, "load_before": load_before, "load_after": _load(),
            "timing_seconds": round(time.perf_counter() - started, 1), "capacity": capacity,
            "session_mode": exports["with_head"].backend.session_mode,
            "peak_rss_gb_timing_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def summarise(samples: dict[str, list[float]], catch_up: list[int]) -> dict[str, Any]:
    """Medians, spreads and the shares (ratio of medians; median of each round's ratio)."""
    medians = {name: round(_median(values), 3) for name, values in samples.items()}
    spread = {name: [round(min(v), 3), round(statistics.quantiles(v, n=4)[0], 3),
                     round(statistics.quantiles(v, n=4)[2], 3), round(max(v), 3)] for name, v in samples.items()}

    def share(num: str, den: str) -> dict[str, float]:
        paired = [a / b for a, b in zip(samples[num], samples[den], strict=True)]
        return {"ratio_of_medians": round(medians[num] / medians[den], 4), "median_of_ratios": round(_median(paired), 4)}

    return {"median_ms": medians, "min_q1_q3_max_ms": spread,
            "head_step_share": share("head_s1", "target_with_head"),
            "target_hidden_cost": share("target_with_head", "target_plain"),
            "catch_up_share": {s: share(f"head_s{s}", "target_with_head") for s in catch_up}}


def add_timing_arguments(parser: argparse.ArgumentParser, work: Path) -> None:
    """The options of the timing (and of the making steps' cap), shared with benchmarks/mtp_head_cost.py."""
    parser.add_argument("--work", type=Path, default=work, help="checkpoints and exports")
    parser.add_argument("--context", type=int, default=512, help="cached positions at each timed call")
    parser.add_argument("--runs", type=int, default=31, help="rounds (each call once per round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--catch-up", default="2,3,4", help="head calls over S positions")
    parser.add_argument("--cap-gb", type=float, default=14.0, help="memory cap of each making / export step")
    parser.add_argument("--spinning", choices=("both", "on", "off"), default="both",
                        help="ONNX Runtime's intra-op threads busy-wait between ops (on: the runtime's default) or "
                             "sleep (off: spinning=False); both: one timing of each, one after the other. With three "
                             "sessions taking turns on shared cores, an idle session's spinning threads take CPU "
                             "from the running one")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle time before each timed call, so that the previous call's session's spinning "
                             "threads have stopped (0: back to back)")


def time_modes(work: Path, args: argparse.Namespace, catch_up: list[int],
               folders: tuple[str, str] = ("ort-eagle", "ort-plain")) -> dict[str, Any]:
    """measure + summarise for each spinning mode that args.spinning names, one after the other."""
    modes = {}
    for mode in ("on", "off") if args.spinning == "both" else (args.spinning,):
        uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        measured = measure(work, args.context, args.runs, args.threads, catch_up, mode == "on", args.gap_ms / 1e3,
                           folders=folders)
        uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        gc.collect()  # the mode's sessions (~12 GB) go before the next mode's load
        summary = summarise(measured["samples_ms"], catch_up)
        modes[f"spinning_{mode}"] = {
            "uptime_before": uptime_before, "uptime_after": uptime_after, **summary,
            "meets_15_percent": summary["head_step_share"]["median_of_ratios"] <= 0.15, "timing": measured}
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_arguments(parser, Path("/tmp/eagle3-1b"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = args.work.absolute()
    catch_up = [int(s) for s in args.catch_up.split(",") if s]
    made = prepare(work, args.cap_gb)
    try:  # the timing process joins the cap too (both targets and the head are held: ~11 GB)
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        pass
    report: dict[str, Any] = {
        "issue": 54, "shape": SHAPE, "dtype": "fp32", "target": "ort", "head": {**HEAD, "aux_layer_ids": [2, 8, 13]},
        **run_record(args), "weights_share": weights_share(work / "llama-1b", work / "head"), "making": made}
    report["modes"] = time_modes(work, args, catch_up)
    write_report(report, args.json)
    return 0


def run_record(args: argparse.Namespace) -> dict[str, Any]:
    """The timing's settings and the machine it ran on (both head-cost scripts' reports)."""
    import onnxruntime

    return {"context": args.context, "runs": args.runs, "threads": args.threads, "gap_ms": args.gap_ms,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "onnxruntime": onnxruntime.__version__,
            "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), None), "cores": os.cpu_count()}


def write_report(report: dict[str, Any], path: Path | None) -> None:
    """The report printed, and written to `path` where given."""
    text = json.dumps(report, indent=1)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
