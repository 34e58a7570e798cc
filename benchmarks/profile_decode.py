"""Op-level comparison of one kvforge export's batch-1 decode step with onnxruntime-genai's model.

Each system runs in its own process (as `kvforge bench` does): a warm-up generation, then one timed
generation (PROMPT tokens, NEW greedy tokens) with ONNX Runtime's profiler on. The last NEW - 1 graph
runs of each trace are the decode steps; their node events are summed per op type and per layer
and divided by the number of steps. Time outside the graph run is the step's wall time minus the
graph's: kvforge's is split further with perf_counter around its parts (the IO binding call, the
decode input write and cache checks, sampling, the Python loop); onnxruntime-genai's is one number.
It also diffs the two graphs statically (op counts, inputs' dynamic dims, Casts, the logits
Gather, contrib ops) and the session options each runs with.

A script rather than a `kvforge bench` flag: it reads ONNX Runtime's profiler JSON (a diagnostic
format, not an API) and is for whoever is chasing a gap, not for users measuring their export.

    python benchmarks/profile_decode.py EXPORT_DIR [--prompt-len 128] [--new-tokens 64] [--threads 2]
        [--json out.json] [--kvforge-option KEY=VALUE ...]   # extra ORT session config entries, kvforge only
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx

from kvforge.core.manifest import load_manifest
from kvforge.tools.bench import _genai_model
from kvforge.tools.bench_workers import prompt_ids

NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


# -- workers ----------------------------------------------------------------------------------------
class _Clock:
    """Accumulated seconds per label, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if clock.on:
                    clock.calls[label].append(time.perf_counter() - start)

        setattr(owner, name, timed)


def work_kvforge(path: str, prompt_len: int, new: int, threads: int, out: str, entries: dict[str, str]) -> dict:
    import onnxruntime as ort

    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.backends import ort_backend
    from kvforge.runtime.controls import sampling
    from kvforge.runtime.drivers import decode_loop

    # Profiling on (and any extra config entries) for every session the backend creates.
    plain = ort.SessionOptions

    def options() -> ort.SessionOptions:
        made = plain()
        made.enable_profiling = True
        made.profile_file_prefix = str(Path(out) / "kvforge")
        for key, value in entries.items():
            made.add_session_config_entry(key, value)
        return made

    ort_backend.ort.SessionOptions = options  # type: ignore[misc]
    clock = _Clock()
    session_class = ort.InferenceSession
    clock.wrap(session_class, "run_with_iobinding", "graph_call")  # the C++ run, seen from Python
    clock.wrap(ort_backend.OrtBackend, "run_decode", "run_decode")  # + decode input write, cache checks, sync
    clock.wrap(sampling.Sampler, "__call__", "sampling")
    clock.wrap(decode_loop._Rows, "accept", "accept")  # append token, Stopper, StepEvent
    stamps: list[float] = []
    accept = decode_loop._Rows.accept

    def stamped(*args: Any, **kwargs: Any) -> Any:
        stamps.append(time.perf_counter())  # one accept per step: the gaps are the steps' walls
        return accept(*args, **kwargs)

    decode_loop._Rows.accept = stamped  # type: ignore[method-assign]
    gen = Generator(path, threads=threads)
    request = GenerationRequest([prompt_ids(prompt_len, 0, gen.vocab_size)], new, ignore_eos=True)
    gen.generate(request.replace(max_new_tokens=8))
    clock.on = True
    stamps.clear()
    result = gen.generate(request)
    clock.on = False
    walls = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    trace = gen.backend.sessions["decode"].end_profiling()
    session = gen.backend.sessions["decode"]
    # The timed generation is one prefill run, then result.steps decode runs: only those are kept.
    decode_calls = {k: v[-result.steps:] for k, v in clock.calls.items()}
    return {"trace": trace, "steps": result.steps, "step_ms": 1e3 * statistics.median(walls),
            "mean_step_ms": result.decode_ms / result.steps,
            "parts_ms": {k: 1e3 * statistics.median(v) for k, v in decode_calls.items()},
            "graph": str(Path(path) / ("prefill.onnx" if gen.backend.session_mode == "single" else "decode.onnx")),
            "session": _session_options(session)}


def work_genai(path: str, prompt_len: int, new: int, threads: int, out: str, entries: dict[str, str]) -> dict:
    import onnxruntime_genai as og

    config = og.Config(path)
    session_options: dict[str, Any] = {"intra_op_num_threads": threads, "enable_profiling": str(Path(out) / "genai")}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": session_options}}}))
    model = og.Model(config)
    vocab = json.loads((Path(path) / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = prompt_ids(prompt_len, 0, vocab)

    def run(model: Any, tokens: int) -> list[float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + tokens, min_length=prompt_len + tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        times = []
        while not generator.is_done():
            start = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - start)
        return times

    run(model, 8)
    times = run(model, new)
    del model  # the profile is written when the session closes
    import gc

    gc.collect()
    traces = sorted(Path(out).glob("genai*.json"))
    return {"trace": str(traces[-1]) if traces else "", "steps": len(times),
            "step_ms": 1e3 * statistics.median(times), "mean_step_ms": 1e3 * sum(times) / len(times), "parts_ms": {},
            "graph": str(Path(path) / "model.onnx"),
            "session": {**json.loads((Path(path) / "genai_config.json").read_text())["model"]["decoder"]["session_options"],
                        **session_options}}


def _session_options(session: Any) -> dict[str, Any]:
    options = session.get_session_options()
    return {"config entries": {k: options.get_session_config_entry(k) for k in (
                "session.intra_op.allow_spinning", "session.disable_prepacking", "session.use_env_allocators")
                if _has_entry(options, k)},
            "intra_op_num_threads": options.intra_op_num_threads,
            "graph_optimization_level": str(options.graph_optimization_level),
            "enable_cpu_mem_arena": options.enable_cpu_mem_arena, "enable_mem_pattern": options.enable_mem_pattern,
            "execution_mode": str(options.execution_mode)}


def _has_entry(options: Any, key: str) -> bool:
    try:
        options.get_session_config_entry(key)
        return True
    except Exception:  # ORT raises when the entry was never set (its default applies)
        return False


WORKERS = {"kvforge": work_kvforge, "ort-genai": work_genai}


# -- the trace --------------------------------------------------------------------------------------
def decode_ops(trace: str, steps: int) -> dict[str, Any]:
    """Per-op-type and per-layer ms over the last `steps` model runs of `trace`. Each node's time is
    its median over the steps, then nodes are summed by op type and by layer: on a shared machine a
    preempted intra-op thread stalls one node of most steps for a scheduler slice, which a per-step
    sum would count and a per-node median does not. `run_ms` is the median graph run, spikes and all."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    times: dict[str, list[float]] = collections.defaultdict(list)
    where: dict[str, tuple[str, str]] = {}  # node -> (op type, layer)
    i = 0
    for run in runs:
        end = run["ts"] + run["dur"]
        while i < len(nodes) and nodes[i]["ts"] < run["ts"]:
            i += 1
        norms = 0  # layer k holds norms 2k and 2k+1 (input, post-attention): node names need not say
        while i < len(nodes) and nodes[i]["ts"] <= end:
            node = nodes[i]
            op = node["args"].get("op_name", "?")
            norms += op in NORMS
            where[node["name"]] = (op, "embedding" if norms == 0 else "lm_head" if norms > 60 else str((norms - 1) // 2))
            times[node["name"]].append(node["dur"] / 1e3)
            i += 1
    op_ms: dict[str, float] = collections.defaultdict(float)
    layer_ms: dict[str, float] = collections.defaultdict(float)
    for name, values in times.items():
        op, layer = where[name]
        op_ms[op] += statistics.median(values)
        layer_ms[layer] += statistics.median(values)
    walls = [r["dur"] / 1e3 for r in runs]
    return {"run_ms": statistics.median(walls), "run_ms_min": min(walls),
            "op_count": dict(collections.Counter(op for op, _ in where.values())),
            "op_ms": dict(op_ms), "layer_ms": dict(layer_ms)}


# -- the static diff --------------------------------------------------------------------------------
def graph_facts(path: str) -> dict[str, Any]:
    model = onnx.load(path, load_external_data=False)
    ops = collections.Counter(f"{n.domain + '.' if n.domain not in ('', 'ai.onnx') else ''}{n.op_type}"
                              for n in model.graph.node)
    inputs = {}
    for value in model.graph.input:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        inputs[value.name] = dims
    return {"ops": dict(ops), "inputs": inputs, "nodes": len(model.graph.node)}


# -- the orchestrator -------------------------------------------------------------------------------
def _spawn(system: str, path: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, path, str(args.prompt_len), str(args.new_tokens),
           str(args.threads), out, json.dumps(dict(e.split("=", 1) for e in args.kvforge_option))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(dicts: Any) -> dict[str, float]:
    dicts = list(dicts)
    return {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in {k for d in dicts for k in d}}


def _table(title: str, left: dict[str, float], right: dict[str, float], key: Any = None, counts: tuple = ()) -> list[str]:
    lines = [title, f"{'':<34}{'kvforge':>10}{'ort-genai':>11}{'diff':>9}" + ("   count kv/genai" if counts else "")]
    names = sorted(set(left) | set(right), key=key or (lambda k: -(left.get(k, 0) + right.get(k, 0))))
    for name in names:
        a, b = left.get(name, 0.0), right.get(name, 0.0)
        extra = f"   {counts[0].get(name, 0)}/{counts[1].get(name, 0)}" if counts else ""
        lines.append(f"{name:<34}{a:>10.3f}{b:>11.3f}{a - b:>+9.3f}{extra}")
    lines.append(f"{'total':<34}{sum(left.values()):>10.3f}{sum(right.values()):>11.3f}"
                 f"{sum(left.values()) - sum(right.values()):>+9.3f}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; tables show per-entry medians")
    parser.add_argument("--kvforge-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    manifest = load_manifest(args.export)
    source = Path(manifest["model"]["source"])
    genai_dir = str(_genai_model(source, "int4" if (manifest.get("quantization") or {}).get("bits") == 4 else "fp32",
                                 lambda m: print(m, file=sys.stderr)))
    report: dict[str, Any] = {"export": args.export, "genai_model": genai_dir, "systems": {}, "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):  # take turns, so machine noise hits both alike
            runs = {}
            for system, path in (("kvforge", args.export), ("ort-genai", genai_dir)):
                print(f"round {round_ + 1}/{args.rounds}: {system}", file=sys.stderr)
                out = Path(tmp) / f"{system}-{round_}"
                out.mkdir()
                info = _spawn(system, path, args, str(out))
                info["profile"] = decode_ops(info["trace"], info["steps"])
                runs[system] = info
            report["rounds"].append(runs)
    for system in ("kvforge", "ort-genai"):
        rounds = [r[system] for r in report["rounds"]]
        merged = dict(rounds[0])
        merged["step_ms"] = statistics.median(r["step_ms"] for r in rounds)
        merged["step_ms_spread"] = [min(r["step_ms"] for r in rounds), max(r["step_ms"] for r in rounds)]
        merged["parts_ms"] = _median(r["parts_ms"] for r in rounds)
        merged["profile"] = {"run_ms": statistics.median(r["profile"]["run_ms"] for r in rounds),
                             "run_ms_min": min(r["profile"]["run_ms_min"] for r in rounds),
                             "op_count": rounds[0]["profile"]["op_count"],
                             "op_ms": _median(r["profile"]["op_ms"] for r in rounds),
                             "layer_ms": _median(r["profile"]["layer_ms"] for r in rounds)}
        merged["static"] = graph_facts(merged["graph"])
        report["systems"][system] = merged
    kv, ga = report["systems"]["kvforge"], report["systems"]["ort-genai"]
    lines = [f"{args.export} vs {genai_dir}: prompt {args.prompt_len}, {args.new_tokens} new, "
             f"{args.threads} threads, ms per decode step (profiler on), medians of {args.rounds} alternating rounds; "
             f"load average {os.getloadavg()[0]:.1f}"]
    lines += _table("per op type (ms per step)", kv["profile"]["op_ms"], ga["profile"]["op_ms"],
                    counts=(kv["profile"]["op_count"], ga["profile"]["op_count"]))
    lines += _table("per layer (ms per step)", kv["profile"]["layer_ms"], ga["profile"]["layer_ms"],
                    key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0))
    lines.append("step (wall)                           kvforge  ort-genai")
    lines.append(f"{'whole step':<34}{kv['step_ms']:>10.3f}{ga['step_ms']:>11.3f}   spread kvforge "
                 f"{kv['step_ms_spread'][0]:.2f}-{kv['step_ms_spread'][1]:.2f}, ort-genai "
                 f"{ga['step_ms_spread'][0]:.2f}-{ga['step_ms_spread'][1]:.2f}")
    lines.append(f"{'graph run (model_run)':<34}{kv['profile']['run_ms']:>10.3f}{ga['profile']['run_ms']:>11.3f}")
    lines.append(f"{'fastest graph run':<34}{kv['profile']['run_ms_min']:>10.3f}{ga['profile']['run_ms_min']:>11.3f}")
    lines.append(f"{'outside the graph run':<34}{kv['step_ms'] - kv['profile']['run_ms']:>10.3f}"
                 f"{ga['step_ms'] - ga['profile']['run_ms']:>11.3f}")
    parts = kv["parts_ms"]
    lines.append("kvforge outside the graph, ms per step:")
    lines.append(f"  run_with_iobinding call - model_run: {parts.get('graph_call', 0) - kv['profile']['run_ms']:.3f}")
    lines.append(f"  run_decode - run_with_iobinding (input write, cache checks, sync): "
                 f"{parts.get('run_decode', 0) - parts.get('graph_call', 0):.3f}")
    lines.append(f"  sampling: {parts.get('sampling', 0):.3f}   accept (tokens, stopper, event): {parts.get('accept', 0):.3f}")
    lines.append(f"  rest of the Python loop: {kv['step_ms'] - parts.get('run_decode', 0) - parts.get('sampling', 0) - parts.get('accept', 0):.3f}")
    lines.append("static graphs (op: kvforge / ort-genai):")
    ops = sorted(set(kv["static"]["ops"]) | set(ga["static"]["ops"]))
    lines.append("  " + ", ".join(f"{op} {kv['static']['ops'].get(op, 0)}/{ga['static']['ops'].get(op, 0)}" for op in ops))
    for name, info in (("kvforge", kv), ("ort-genai", ga)):
        inputs = info["static"]["inputs"]
        caches = [k for k in inputs if re.search(r"\d", k)]
        shown = {k: v for k, v in inputs.items() if k not in caches}
        lines.append(f"  {name} inputs: {shown}; {len(caches)} cache inputs like {caches[0]} {inputs[caches[0]]}")
    lines.append(f"  kvforge session: {kv['session']}")
    lines.append(f"  ort-genai session_options (genai_config.json + this run's overlay; the rest ORT defaults): {ga['session']}")
    report["text"] = "\n".join(lines)
    print(report["text"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        system, path, prompt_len, new, threads, out, entries = sys.argv[2:9]
        print(json.dumps(WORKERS[system](path, int(prompt_len), int(new), int(threads), out, json.loads(entries))))
    else:
        main()
