"""Median and 10th-percentile wall time of single decode steps, kvforge vs onnxruntime-genai, one system
per process, alternating order round by round.

Why: `kvforge bench` reports each system's mean decode rate, and on a shared machine one preempted
stretch moves a mean by several percent. The median step of a 128-step decode is not moved by it,
so the per-round ratio of medians has a smaller spread than the ratio of means.

    python benchmarks/step_medians.py EXPORT_DIR GENAI_MODEL_DIR [--rounds 8] [--new-tokens 128]

GENAI_MODEL_DIR is the model `kvforge bench --compare ort-genai` built (~/.cache/kvforge/bench/genai-*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvforge.tools.bench_workers import prompt_ids


class _TimedSession:
    """The decode session with each graph run timed, to split a step into the run and the host's
    work around it (Python, sampling, bookkeeping), which onnxruntime-genai does in C++."""

    def __init__(self, session: object) -> None:
        self.session, self.runs = session, []

    def run_with_iobinding(self, binding: object, options: object) -> None:
        started = time.perf_counter()
        self.session.run_with_iobinding(binding, options)
        self.runs.append(time.perf_counter() - started)

    def __getattr__(self, name: str) -> object:
        return getattr(self.session, name)


def _steps_kvforge(path: str, new: int) -> tuple[list[float], list[float]]:
    from kvforge.runtime import GenerationRequest, Generator

    gen = Generator(path, threads=2)
    timed = gen.backend.sessions["decode"] = _TimedSession(gen.backend.sessions["decode"])
    request = GenerationRequest([prompt_ids(128, 0, gen.vocab_size)], new, ignore_eos=True)
    gen.generate(request.replace(max_new_tokens=8))  # warm-up
    timed.runs.clear()
    times, last = [], time.perf_counter()
    for _ in gen.stream(request):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[1:], list(timed.runs)  # the first event is the prefill's token; every timed run is a decode step


def _steps_genai(path: str, new: int) -> list[float]:
    import onnxruntime_genai as og

    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 2}}}}))
    model = og.Model(config)
    vocab = json.loads((Path(path) / "genai_config.json").read_text())["model"]["vocab_size"]

    def run(tokens: int) -> list[float]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=128 + tokens, min_length=128 + tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt_ids(128, 0, vocab))
        generator.generate_next_token()  # samples the prefill's logits
        times, last = [], time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    run(8)  # warm-up
    return run(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir")
    parser.add_argument("genai_dir")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--worker", choices=("kvforge", "genai"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        runs: list[float] = []
        if args.worker == "kvforge":
            steps, runs = _steps_kvforge(args.export_dir, args.new_tokens)
        else:
            steps = _steps_genai(args.genai_dir, args.new_tokens)
        out = {"median_ms": 1e3 * statistics.median(steps), "p10_ms": 1e3 * sorted(steps)[len(steps) // 10]}
        if runs:  # kvforge: the median graph run, and the mean host time per step outside it
            out.update(run_ms=1e3 * statistics.median(runs), host_ms=1e3 * (sum(steps) - sum(runs)) / len(steps))
        print(json.dumps(out))
        return
    ratios: dict[str, list[float]] = {"median_ms": [], "p10_ms": []}
    host: list[float] = []
    runs_vs_genai: list[float] = []
    for round_ in range(args.rounds):
        order = ("kvforge", "genai") if round_ % 2 == 0 else ("genai", "kvforge")
        got = {}
        for system in order:
            out = subprocess.run([sys.executable, __file__, args.export_dir, args.genai_dir, "--new-tokens",
                                  str(args.new_tokens), "--worker", system], capture_output=True, text=True, check=True)
            got[system] = json.loads(out.stdout.strip().splitlines()[-1])
        for key in ratios:
            ratios[key].append(got["genai"][key] / got["kvforge"][key])  # > 1: kvforge's step is shorter
        host.append(got["kvforge"]["host_ms"])
        runs_vs_genai.append(got["genai"]["median_ms"] / got["kvforge"]["run_ms"])
        print(f"round {round_ + 1}: kvforge {got['kvforge']['median_ms']:.2f} ms (graph run {got['kvforge']['run_ms']:.2f} "
              f"+ host {got['kvforge']['host_ms']:.2f}), genai {got['genai']['median_ms']:.2f} ms (median step), "
              f"ratio {ratios['median_ms'][-1]:.3f}", flush=True)
    for key, values in ratios.items():
        print(f"{key}: median kvforge/genai speed ratio {statistics.median(values):.3f} over {len(values)} rounds "
              f"({' '.join(f'{v:.2f}' for v in values)})")
    print(f"kvforge's host time outside the graph run: median {statistics.median(host):.2f} ms a step; genai's median "
          f"step over kvforge's median graph run alone: {statistics.median(runs_vs_genai):.3f}")


if __name__ == "__main__":
    main()
