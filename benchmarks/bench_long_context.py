"""Decode speed at long cache positions: kvforge (fp32 KV cache, and optionally an int8 one) against
onnxruntime-genai, alternating in one script so every system sees the same machine load.

For each round, each cache position P and each system (the order rotates per round), one process runs
`python -m kvforge.tools.bench worker` (kvforge/tools/bench.py): a short warm-up generation, then a P-token prompt
(prefill, timed as TTFT) and NEW greedy tokens, EOS ignored; decode tokens/s is the NEW - 1 steps after
the first token, at cache positions P .. P + NEW - 2: the prefill is not in it. The load average is
read before each process. Reported: medians over rounds, and the median of the per-round ratios.

    python benchmarks/bench_long_context.py --fp32 kvforge-demo/smollm2-135m-instruct-ort \\
        [--int8 EXPORT_WITH_KV_CACHE_INT8] [--positions 2048,8000] [--new-tokens 64] [--repeat 3] [--json OUT]

onnxruntime-genai's fp32 model is built from the fp32 export's source folder (cached, as `kvforge bench
--compare ort-genai` does). The int8 rows also report whether their greedy tokens equal the fp32
cache's at each position (how many leading tokens are identical; the prompt is kvforge.tools.bench's
synthetic id pattern, the same for all).

`--fill` (kvforge only, with --no-peer): decode at position P without the P-token prefill, for caches
whose prefill is slow (ONNX Runtime's CPU prefill over an int8 cache is several times slower than over
fp32): the cache is allocated (zeros), a FILL_CHUNK-token prompt is prefilled at past_lens = P -
FILL_CHUNK (a chunked prefill, legal by the KV contract) and NEW greedy steps follow. A decode step's
cost does not depend on what the cache holds, so this is the decode speed at P; compare its fp32
figure with the real-prefill run to check (`--check-fill` adds that run as row kvforge-prefilled). It
also times one PREFILL_LEN-token prefill from an empty cache (prefill tokens/s), after a warm-up.

`--interleave` (needs --int8): the fp32 and int8 exports in one process, both filled as above, their
decode steps alternating one by one, each timed (the steadiest fp32/int8 ratio on a shared machine);
`--interleave-prefill N`: N-token prefills of the two alternating in one process; `--interleave-peer`:
kvforge (--fp32) and onnxruntime-genai in one process, each after its own real P-token prefill, their
decode steps alternating one by one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvforge.core.manifest import load_manifest
from kvforge.tools.bench import _genai_model

FILL_CHUNK = 16
PREFILL_LEN = 512


def fill_worker(path: str, position: int, new: int, threads: int) -> dict:
    """Decode tokens/s at cache position `position` after a FILL_CHUNK-token chunk (see --fill)."""
    import time

    import numpy as np

    from kvforge.runtime import Generator
    from kvforge.tools.bench_workers import _peak_rss_mb, prompt_ids

    gen = Generator(path, threads=threads)
    backend = gen.backend
    capacity = next(b for b in backend.limits.capacity_buckets if b >= max(position + new, PREFILL_LEN))
    slot = backend.allocate(1, capacity)
    lens = slot.cache.past_lens  # the caller advances past_lens (runtime/backends/ort_backend.py)
    chunk = np.array([prompt_ids(FILL_CHUNK, 0, gen.vocab_size)], np.int64)

    def decode(start: int, steps: int) -> tuple[float, list[int]]:
        lens[:] = start
        token = int(backend.prefill(slot, chunk, np.array([FILL_CHUNK - 1]))[0].argmax())
        lens[:] += FILL_CHUNK
        tokens = [token]
        began = time.perf_counter()
        for _ in range(steps - 1):
            token = int(backend.decode(slot, np.array([token]))[0].argmax())
            lens[:] += 1
            tokens.append(token)
        return (steps - 1) / (time.perf_counter() - began), tokens

    def prefill() -> float:
        lens[:] = 0
        ids = np.array([prompt_ids(PREFILL_LEN, 0, gen.vocab_size)], np.int64)
        began = time.perf_counter()
        backend.prefill(slot, ids, np.array([PREFILL_LEN - 1]))
        return PREFILL_LEN / (time.perf_counter() - began)

    decode(0, 8)  # warm-up
    prefill()
    prefill_tps = prefill()
    tps, tokens = decode(position - FILL_CHUNK, new)
    return {"decode_tokens_per_s": tps, "ttft_ms": 1e3 * PREFILL_LEN / prefill_tps, "prefill_tokens_per_s": prefill_tps,
            "tokens": [tokens], "peak_rss_mb": _peak_rss_mb()}


def interleaved(paths: dict[str, str], position: int, steps: int, threads: int) -> dict:
    """`--interleave`: both exports in this one process, each filled to `position` like --fill, then
    their decode steps alternate one by one (A, B, A, B, ...), each timed: the same load for both at
    the finest grain. Returns each one's median step ms and the ratio."""
    import time

    import numpy as np

    from kvforge.runtime import Generator
    from kvforge.tools.bench_workers import prompt_ids

    runs = {}
    for name, path in paths.items():
        gen = Generator(path, threads=threads)
        backend = gen.backend
        capacity = next(b for b in backend.limits.capacity_buckets if b >= position + steps + FILL_CHUNK)
        slot = backend.allocate(1, capacity)
        slot.cache.past_lens[:] = position - FILL_CHUNK
        chunk = np.array([prompt_ids(FILL_CHUNK, 0, gen.vocab_size)], np.int64)
        token = int(backend.prefill(slot, chunk, np.array([FILL_CHUNK - 1]))[0].argmax())
        slot.cache.past_lens[:] += FILL_CHUNK
        runs[name] = {"backend": backend, "slot": slot, "token": token, "ms": []}
    for step in range(steps + 4):  # the first 4 rounds warm up
        for run in runs.values():
            began = time.perf_counter()
            run["token"] = int(run["backend"].decode(run["slot"], np.array([run["token"]]))[0].argmax())
            elapsed = time.perf_counter() - began
            run["slot"].cache.past_lens[:] += 1
            if step >= 4:
                run["ms"].append(1e3 * elapsed)
    medians = {name: statistics.median(run["ms"]) for name, run in runs.items()}
    first, second = list(medians)
    return {"position": position, "steps": steps, "median_step_ms": medians,
            f"{second}_speed_over_{first}": medians[first] / medians[second], "load1": os.getloadavg()[0]}


def prefill_interleaved(paths: dict[str, str], length: int, rounds: int, threads: int) -> dict:
    """`--interleave-prefill N`: one N-token prefill from an empty cache per export and round, the
    exports alternating in this one process (after a 64-token warm-up each); median seconds each."""
    import time

    import numpy as np

    from kvforge.runtime import Generator
    from kvforge.tools.bench_workers import prompt_ids

    runs = {}
    for name, path in paths.items():
        gen = Generator(path, threads=threads)
        slot = gen.backend.allocate(1, next(b for b in gen.backend.limits.capacity_buckets if b >= length))
        ids = np.array([prompt_ids(length, 0, gen.vocab_size)], np.int64)
        gen.backend.prefill(slot, ids[:, :64], np.array([63]))
        runs[name] = {"backend": gen.backend, "slot": slot, "ids": ids, "s": []}
    for _ in range(rounds):
        for name, run in runs.items():
            run["slot"].cache.past_lens[:] = 0
            began = time.perf_counter()
            run["backend"].prefill(run["slot"], run["ids"], np.array([length - 1]))
            run["s"].append(time.perf_counter() - began)
            print(f"prefill {length} {name}: {run['s'][-1]:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    return {name: statistics.median(run["s"]) for name, run in runs.items()}


def peer_interleaved(export: str, genai_dir: str, position: int, steps: int, threads: int) -> dict:
    """`--interleave-peer`: kvforge (fp32 export) and onnxruntime-genai in this one process, each given
    the same P-token prompt (a real prefill each), then their decode steps alternate one by one, each
    timed. Median step ms of each and kvforge's speed over genai's."""
    import time

    import numpy as np
    import onnxruntime_genai as og

    from kvforge.runtime import Generator
    from kvforge.tools.bench_workers import prompt_ids

    gen = Generator(export, threads=threads)
    backend = gen.backend
    ids = prompt_ids(position, 0, gen.vocab_size)
    slot = backend.allocate(1, next(b for b in backend.limits.capacity_buckets if b >= position + steps + 4))
    token = int(backend.prefill(slot, np.array([ids], np.int64), np.array([position - 1]))[0].argmax())
    slot.cache.past_lens[:] = position
    config = og.Config(genai_dir)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=position + steps + 5, min_length=position + steps + 5, do_sample=False)
    peer = og.Generator(model, params)
    peer.append_tokens(ids)
    ms: dict[str, list[float]] = {"kvforge": [], "ort-genai": []}
    for step in range(steps + 4):  # the first 4 rounds warm up
        began = time.perf_counter()
        token = int(backend.decode(slot, np.array([token]))[0].argmax())
        middle = time.perf_counter()
        slot.cache.past_lens[:] += 1
        peer.generate_next_token()
        end = time.perf_counter()
        if step >= 4:
            ms["kvforge"].append(1e3 * (middle - began))
            ms["ort-genai"].append(1e3 * (end - middle))
    medians = {name: statistics.median(values) for name, values in ms.items()}
    return {"position": position, "median_step_ms": medians, "kvforge_over_peer": medians["ort-genai"] / medians["kvforge"],
            "load1": os.getloadavg()[0]}


def run_worker(system: str, path: str, position: int, new: int, threads: int, fill: bool = False) -> dict:
    if fill:
        command = [sys.executable, __file__, "--worker-fill", path, str(position), str(new), str(threads)]
    else:
        command = [sys.executable, "-m", "kvforge.tools.bench", "worker", system, path, str(position), str(new), "1",
                   str(threads), "1"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} at {position}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp32", required=True, help="kvforge export (ort target, fp32 KV cache)")
    parser.add_argument("--int8", help="the same model exported with --kv-cache int8")
    parser.add_argument("--positions", default="2048,8000")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="kvforge only (fp32 vs int8 cache)")
    parser.add_argument("--fill", action="store_true", help="kvforge decode at P after a short chunk (see above)")
    parser.add_argument("--interleave", action="store_true",
                        help="fp32 vs --int8 decode steps alternating one by one in one process (see interleaved())")
    parser.add_argument("--interleave-prefill", type=int, metavar="N",
                        help="fp32 vs --int8: N-token prefills alternating in one process, --repeat rounds")
    parser.add_argument("--interleave-peer", action="store_true",
                        help="kvforge vs onnxruntime-genai decode steps alternating one by one in one process")
    parser.add_argument("--check-fill", action="store_true",
                        help="with --fill: also the fp32 export with a real P-token prefill (row kvforge-prefilled)")
    parser.add_argument("--json", type=Path, help="write the raw runs and the summary here")
    args = parser.parse_args()
    if args.fill and not args.no_peer:
        parser.error("--fill measures kvforge only: add --no-peer")
    if args.interleave_peer:
        genai_dir = str(_genai_model(Path(load_manifest(args.fp32)["model"]["source"]), "fp32", print))
        for round_ in range(args.repeat):
            for position in (int(p) for p in args.positions.split(",")):
                result = peer_interleaved(args.fp32, genai_dir, position, args.new_tokens, args.threads)
                print(f"round {round_ + 1} P={position}: median step kvforge {result['median_step_ms']['kvforge']:.1f} ms, "
                      f"ort-genai {result['median_step_ms']['ort-genai']:.1f} ms: kvforge x{result['kvforge_over_peer']:.2f} "
                      f"(load {result['load1']:.1f})", flush=True)
        return
    if args.interleave_prefill:
        medians = prefill_interleaved({"fp32": args.fp32, "int8": args.int8}, args.interleave_prefill, args.repeat,
                                      args.threads)
        print(f"prefill {args.interleave_prefill} tokens, median of {args.repeat}: fp32 {medians['fp32']:.1f} s, "
              f"int8 {medians['int8']:.1f} s (int8 cache x{medians['fp32'] / medians['int8']:.2f} speed)")
        return
    if args.interleave:
        if not args.int8:
            parser.error("--interleave compares --fp32 with --int8")
        results = []
        for round_ in range(args.repeat):
            for position in (int(p) for p in args.positions.split(",")):
                result = interleaved({"fp32": args.fp32, "int8": args.int8}, position, args.new_tokens, args.threads)
                results.append(result)
                print(f"round {round_ + 1} P={position}: median step fp32 {result['median_step_ms']['fp32']:.1f} ms, "
                      f"int8 {result['median_step_ms']['int8']:.1f} ms: int8 cache x{result['int8_speed_over_fp32']:.2f} "
                      f"(load {result['load1']:.1f})", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    positions = [int(p) for p in args.positions.split(",")]
    source = Path(load_manifest(args.fp32)["model"]["source"])
    systems = {"kvforge": ("kvforge", args.fp32)}
    if args.int8:
        systems["kvforge-int8kv"] = ("kvforge", args.int8)
    if args.check_fill:
        systems["kvforge-prefilled"] = ("kvforge", args.fp32)
    if not args.no_peer:
        systems["ort-genai"] = ("ort-genai", str(_genai_model(source, "fp32", print)))
    runs: dict[str, dict[str, list[dict]]] = {str(p): {name: [] for name in systems} for p in positions}
    names = list(systems)
    for round_ in range(args.repeat):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for position in positions:
            for name in order:
                worker, path = systems[name]
                load = os.getloadavg()[0]
                result = run_worker(worker, path, position, args.new_tokens, args.threads,
                                    args.fill and name != "kvforge-prefilled")
                result["load1"] = load
                runs[str(position)][name].append(result)
                print(f"round {round_ + 1} P={position} {name}: decode {result['decode_tokens_per_s']:.1f} tok/s, "
                      f"TTFT {result['ttft_ms'] / 1e3:.1f} s, load {load:.1f}", flush=True)
    summary: dict[str, dict] = {}
    for position, by_system in runs.items():
        rows: dict[str, dict] = {}
        for name, samples in by_system.items():
            tps = [s["decode_tokens_per_s"] for s in samples]
            rows[name] = {"decode_tokens_per_s": statistics.median(tps), "spread": [min(tps), max(tps)],
                          "ttft_s": statistics.median(s["ttft_ms"] for s in samples) / 1e3,
                          **({"prefill_tokens_per_s": statistics.median(s["prefill_tokens_per_s"] for s in samples)}
                             if "prefill_tokens_per_s" in samples[0] else {}),
                          "peak_rss_mb": statistics.median(s["peak_rss_mb"] for s in samples)}
        base = by_system["kvforge"]
        for name, samples in by_system.items():
            if name == "kvforge":
                continue
            ratios = [b["decode_tokens_per_s"] / s["decode_tokens_per_s"] for b, s in zip(base, samples, strict=True)]
            key = {"ort-genai": "kvforge_over_peer", "kvforge-prefilled": "over_fill"}.get(name, "over_fp32_cache")
            rows[name][key] = statistics.median(ratios) if name == "ort-genai" else statistics.median(1 / r for r in ratios)
            if "tokens" in samples[0] and not args.fill:  # a filled cache holds zeros: its tokens mean nothing
                ours, theirs = samples[0]["tokens"][0], base[0]["tokens"][0]
                same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
                rows[name]["same_greedy_tokens_as_fp32_cache"] = f"first {same}/{len(ours)}"
        rows["load1"] = [min(s["load1"] for v in by_system.values() for s in v),
                         max(s["load1"] for v in by_system.values() for s in v)]
        summary[position] = rows
    for position, rows in summary.items():
        print(f"P={position}, {args.new_tokens} new tokens, {args.threads} threads, median of {args.repeat} "
              f"(load average {rows['load1'][0]:.1f}-{rows['load1'][1]:.1f})")
        for name, row in rows.items():
            if name == "load1":
                continue
            extra = "".join(f", {k} {v:.2f}" if isinstance(v, float) else f", {k} {v}" for k, v in row.items()
                            if k in ("kvforge_over_peer", "over_fp32_cache", "over_fill",
                                     "same_greedy_tokens_as_fp32_cache"))
            first = (f"prefill {row['prefill_tokens_per_s']:.0f} tok/s ({PREFILL_LEN} tokens)"
                     if "prefill_tokens_per_s" in row else f"TTFT {row['ttft_s']:.1f} s")
            print(f"  {name:<16} decode {row['decode_tokens_per_s']:6.1f} tok/s ({row['spread'][0]:.1f}-"
                  f"{row['spread'][1]:.1f}), {first}, peak RSS {row['peak_rss_mb']:.0f} MB{extra}")
    if args.json:
        for by_system in runs.values():
            for samples in by_system.values():
                for s in samples:
                    s.pop("tokens", None)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "summary": summary,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker-fill"]:
        path, position, new, threads = sys.argv[2:6]
        print(json.dumps(fill_worker(path, int(position), int(new), int(threads))))
    else:
        main()
