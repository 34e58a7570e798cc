"""Where one ort-cuda decode step's time goes: the graph replay alone, the backend's host work around it,
and the kernels the GPU runs (CUPTI, through torch.profiler), at batch 1 and 8.

    python benchmarks/gpu_step_profile.py EXPORT --out DIR [--steps 300] [--variants default,no-flash]

Per batch, on one slot (prompt 128, CUDA graphs on), each loop timed with perf_counter:
  replay     the decode session's run_with_iobinding alone (graph replay plus its synchronisation)
  host       backend.decode: inputs uploaded, replay, logits copied back and made float32
  device     backend.decode_greedy: inputs uploaded, replay, the pick graph, B ids back
  pieces     an upload (update_inplace), a logits read (OrtValue.numpy), the float32 conversion
and CUPTI's kernel records over 20 replays: kernels per step, their summed time, the GPU's busy span per
step, the top kernels. The device picks are compared with numpy's argmax of the same logits (ties
counted apart). Variants (backend options) run in their own process each:
  flash-attention decode_attention="flash": ONNX Runtime's flash attention first (the default is its own choice)
  host-greedy     device_greedy=False: logits copied back and picked on the host
  no-graphs       CUDA graphs off (each kernel launched by ONNX Runtime)
Writes DIR/step_profile.json and a table on stdout. A diagnostic for whoever chases the step's time.
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

import numpy as np

# name -> backend options of the ort-cuda Generator (given to its process as JSON)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "flash-attention": {"decode_attention": "flash"},  # ONNX Runtime's flash attention first (the default: its own choice)
    "host-greedy": {"device_greedy": False},
    "no-graphs": {"cuda_graphs": False},
}


def _loop(fn: Any, n: int) -> float:
    """Median over 5 chunks of n // 5 calls, in microseconds per call."""
    per = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(max(n // 5, 1)):
            fn()
        per.append((time.perf_counter() - began) / max(n // 5, 1) * 1e6)
    return round(float(np.median(per)), 1)


def _kernels(run_once: Any, steps: int = 20) -> dict[str, Any]:
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as err:
        return {"skipped": f"no torch profiler: {err}"}
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    for _ in range(3):
        run_once()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_once()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not events:
        return {"skipped": "CUPTI recorded no kernels"}
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    # steps: runs of kernels separated by a gap of more than 30 us (the host's turn between replays)
    groups: list[list[tuple[float, float, str]]] = [[spans[0]]]
    for span in spans[1:]:
        if span[0] - max(s[1] for s in groups[-1][-3:]) > 30:
            groups.append([])
        groups[-1].append(span)
    busy = [g[-1][1] - g[0][0] for g in groups]
    by_name: dict[str, list[float]] = {}
    for start, end, name in spans:
        by_name.setdefault(name[:90], []).append(end - start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    total = sum(end - start for start, end, _ in spans)
    return {
        "kernels_per_step": round(len(spans) / steps, 1),
        "kernel_us_per_step": round(total / steps, 1),
        "groups": len(groups),
        "span_us_median": round(float(np.median(busy)), 1) if busy else None,
        "top": [{"kernel": name, "count_per_step": round(len(d) / steps, 1), "us_per_step": round(sum(d) / steps, 1)}
                for name, d in top],
    }


def profile_batch(folder: str, batch: int, steps: int) -> dict[str, Any]:
    from kvforge.runtime import Generator

    if os.environ.get("KVFORGE_PROFILE_SIMULATE"):  # the script's own test on the CPU (tests/runtime/test_device_path.py's way)
        from kvforge.core.manifest import load_manifest
        from kvforge.runtime.backends.ort_backend import OrtBackend

        class Simulated(OrtBackend):
            simulate_device = True

        options = json.loads(os.environ.get("KVFORGE_PROFILE_OPTIONS", "{}"))
        gen = Generator(folder, backend=Simulated(folder, load_manifest(folder), **options))
    else:
        gen = Generator(folder, backend="ort-cuda", **json.loads(os.environ.get("KVFORGE_PROFILE_OPTIONS", "{}")))
    backend = gen.backend
    slot = backend.allocate(batch, 512)
    rng = np.random.default_rng(batch)
    ids = rng.integers(3, min(gen.vocab_size, 30000), size=(batch, 128)).astype(np.int64)
    backend.prefill(slot, ids, np.full(batch, 127, np.int64))
    base = np.full(batch, 128, slot.cache.past_lens.dtype)
    slot.cache.past_lens[:] = base
    feed = ids[:, -1].copy()
    out: dict[str, Any] = {"batch": batch, "cuda_graphs": backend.cuda_graphs, "device_greedy": backend.device_greedy,
                           "pick_graph": getattr(backend.picker, "cuda_graphs", None),
                           "decode_attention": backend.decode_attention}

    # device picks against numpy's argmax of the same logits, over 64 steps of the host path
    mismatch = ties = 0
    for _ in range(64):
        logits = backend.decode(slot, feed).copy()
        slot.cache.past_lens[:] = base
        if backend.device_greedy:
            token, total = backend.decode_greedy(slot, feed)
            slot.cache.past_lens[:] = base
            for b in range(batch):
                if int(token[b]) != int(logits[b].argmax()):
                    mismatch += 1
                    ties += bool(logits[b, int(token[b])] == logits[b].max())
        feed = logits.argmax(-1)
    out["device_pick_vs_numpy"] = {"steps": 64, "rows_differing": mismatch, "of_which_ties": ties}

    session, binding, options = backend.sessions["decode"], slot.bindings["decode"], slot.decode_options

    def replay() -> None:
        session.run_with_iobinding(binding, options)

    def host() -> None:
        backend.decode(slot, feed)

    def device() -> None:
        backend.decode_greedy(slot, feed)

    logits_value = slot.device_values["logits"]
    host_logits = logits_value.numpy()
    past = slot.device_values["past_lens"]
    out["us"] = {
        "replay": _loop(replay, steps),
        "host": _loop(host, steps),
        "device": _loop(device, steps) if backend.device_greedy else None,
        "upload": _loop(lambda: past.update_inplace(slot.cache.past_lens), steps),
        "logits_read": _loop(logits_value.numpy, steps),
        "to_float32": _loop(lambda: host_logits.astype(np.float32), steps),
    }
    slot.cache.past_lens[:] = base
    out["kernels_replay"] = _kernels(replay)
    return out


def _variant_main(folder: str, steps: int) -> None:
    result = {}
    for batch in (1, 8):
        try:
            result[str(batch)] = profile_batch(folder, batch, steps)
        except Exception as err:  # recorded; the other batch still runs
            import traceback

            result[str(batch)] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", default="default,flash-attention,host-greedy")
    parser.add_argument("--variant-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_worker:
        _variant_main(args.export, args.steps)
        return
    report: dict[str, Any] = {"export": args.export}
    for name in args.variants.split(","):
        env = {**os.environ, "KVFORGE_PROFILE_OPTIONS": json.dumps(VARIANTS[name])}
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, args.export, "--steps", str(args.steps), "--variant-worker"],
                              env=env, capture_output=True, text=True, timeout=240)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        report[name] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - began, 1)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "step_profile.json").write_text(json.dumps(report, indent=1))
        for batch, row in report[name].items():
            if isinstance(row, dict) and "us" in row:
                k = row["kernels_replay"]
                print(f"{name:9} b{batch}: {json.dumps(row['us'])} picks {json.dumps(row['device_pick_vs_numpy'])}"
                      f" kernels/step {k.get('kernels_per_step')} kernel_us {k.get('kernel_us_per_step')}"
                      f" span_us {k.get('span_us_median')} {k.get('skipped', '')}", flush=True)
                for top in (k.get("top") or [])[:8]:
                    print(f"    {top['us_per_step']:8.1f} us {top['count_per_step']:6.1f}x  {top['kernel']}", flush=True)
            elif isinstance(row, dict) and "error" in row:
                print(f"{name:9} b{batch}: {row['error']}", flush=True)
        if report[name].get("error"):
            print(f"{name}: {report[name]['error'][-1500:]}", flush=True)


if __name__ == "__main__":
    main()
