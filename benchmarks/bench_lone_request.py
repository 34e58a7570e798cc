"""A lone request through the serving path against `Generator.generate`, and 8 concurrent requests
against 1, on one export.

    python benchmarks/bench_lone_request.py --export kvforge-demo/smollm2-135m-instruct-ort --rounds 5

Each round runs, taking turns: `Generator.generate` (the library), the same request through an
in-process `Scheduler` (max_batch 8, as `kvforge serve`), and through `kvforge serve` (its own
process, httpx, streaming off). The Scheduler and the server also run a second time with every
decode step over all max_batch rows (`*_all_rows`: the scheduler before its batch buckets). Round i
sends prompt i to all of them (the chat template's rendering of a story request when the export has
one, else fixed token ids), greedy, up to --new-tokens tokens, so the server's prefix cache (always
on in `kvforge serve`) finds no earlier turn; the in-process Scheduler's is off. Then 8
different prompts go at once to the Scheduler and to the server, against the same 8 one at a time.

Printed: median tokens/s of each and the medians of the rounds' ratios to the library (decode
tokens/s for the Scheduler, whose first token is timed; end to end for the server, whose
non-streamed answer has only a total), and the aggregate 8-at-once / one-at-a-time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Delta, Scheduler

TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes bread", "two rival chess players",
          "a city under the sea", "a time-travelling cat", "the last library on Mars", "a haunted violin"]


def _prompts(generator: Generator, count: int, vocab: int) -> list[list[int]]:
    try:
        return [generator.chat_ids(f"Write a long story about {topic}.") for topic in TOPICS[:count]]
    except Exception:  # no chat template (a random-weight recipe): fixed token ids
        return [[(7 + 31 * i + 13 * t) % (vocab - 10) + 5 for t in range(32)] for i in range(count)]


def _request(prompt: list[int], new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt, new_tokens, SamplingConfig(greedy=True))


def _library(generator: Generator, prompt: list[int], new_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    result = generator.generate(_request(prompt, new_tokens))
    wall = time.perf_counter() - start
    tokens = len(result.tokens[0])
    return {"tokens": tokens, "decode_tok_s": result.decode_tokens_per_s, "e2e_tok_s": tokens / wall}


def _scheduled(scheduler: Scheduler, prompt: list[int], new_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    handle = scheduler.submit(_request(prompt, new_tokens))
    first = None
    for event in handle:
        if isinstance(event, Delta) and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    tokens = handle.done.completion_tokens
    return {"tokens": tokens, "decode_tok_s": (tokens - 1) / (end - first), "e2e_tok_s": tokens / (end - start)}


def _served(base: str, model: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    reply = httpx.post(f"{base}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": False})
    wall = time.perf_counter() - start
    reply.raise_for_status()
    tokens = reply.json()["usage"]["completion_tokens"]
    return {"tokens": tokens, "e2e_tok_s": tokens / wall}


def _together(run, prompts: list[list[int]]) -> float:
    """Aggregate tokens/s of `run` over `prompts`, all at once."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(r["tokens"] for r in pool.map(run, prompts))
    return tokens / (time.perf_counter() - start)


def _one_at_a_time(run, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    tokens = sum(run(p)["tokens"] for p in prompts)
    return tokens / (time.perf_counter() - start)


# The *_all_rows server: only the max_batch bucket, so every step runs every row (before buckets).
ALL_ROWS = """
import kvforge.runtime.drivers.scheduler as scheduler
init = scheduler.Scheduler.__init__
def all_rows(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self._decode_slots = {self.max_batch: self.slot}
scheduler.Scheduler.__init__ = all_rows
"""


def _start_server(export: str, threads: int, max_batch: int, max_seq_len: int,
                  all_rows: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (ALL_ROWS if all_rows else "") + "from kvforge.cli import main; main()"
    server = subprocess.Popen([sys.executable, "-c", code, "serve", export,
                               "--port", str(port), "--max-batch", str(max_batch), "--threads", str(threads),
                               "--max-seq-len", str(max_seq_len)])
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return server, base
        except httpx.HTTPError:
            if server.poll() is not None:
                raise SystemExit("kvforge serve exited") from None
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", default="kvforge-demo/smollm2-135m-instruct-ort")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--no-server", action="store_true", help="Skip the HTTP server runs.")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    generator = Generator(args.export, threads=args.threads)
    vocab = json.loads((Path(args.export) / "kvforge.json").read_text())["model"]["vocab_size"]
    prompts = _prompts(generator, args.max_batch, vocab)
    max_seq_len = max(map(len, prompts)) + args.new_tokens + 8
    schedulers = [Scheduler(generator, max_batch=args.max_batch, max_seq_len=max_seq_len, prefix_cache_bytes=0)
                  for _ in range(2)]
    schedulers[1]._decode_slots = {args.max_batch: schedulers[1].slot}  # all rows every step
    servers = []
    if not args.no_server:
        for all_rows in (False, True):
            server, base = _start_server(args.export, args.threads, args.max_batch, max_seq_len, all_rows)
            servers.append((server, base, httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]))
    n = args.new_tokens
    systems = {"library": lambda p: _library(generator, p, n)}
    for suffix, scheduler in zip(("", "_all_rows"), schedulers, strict=True):
        systems[f"scheduler{suffix}"] = lambda p, s=scheduler: _scheduled(s, p, n)
        scheduler.start()
    for suffix, (_, base, model) in zip(("", "_all_rows"), servers, strict=False):
        systems[f"server{suffix}"] = lambda p, b=base, m=model: _served(b, m, p, n)
    for run in systems.values():  # warm-up
        run(prompts[-1])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for i in range(args.rounds):  # taking turns, so that the host's load drifts over all of them alike
        for name, run in systems.items():
            runs[name].append(run(prompts[i % len(prompts)]))
    report: dict = {"export": args.export, "new_tokens": n, "rounds": args.rounds, "threads": args.threads,
                    "max_batch": args.max_batch, "load_average": os.getloadavg()[0],
                    "tokens": {name: sorted({r["tokens"] for r in rs}) for name, rs in runs.items()}}
    for name, rs in runs.items():
        for key in ("decode_tok_s", "e2e_tok_s"):
            if key in rs[0]:
                report[f"{name}_{key}"] = statistics.median(r[key] for r in rs)
    for name in systems:  # the median of the rounds' ratios
        if name != "library":
            key = "decode_tok_s" if name.startswith("scheduler") else "e2e_tok_s"
            report[f"{name}_vs_library_{key.split('_')[0]}"] = statistics.median(
                r[key] / lib[key] for r, lib in zip(runs[name], runs["library"], strict=True))
    # Aggregate throughput: all prompts at once against the same prompts one at a time.
    for name in [s for s in ("scheduler", "server") if s in systems]:
        alone = _one_at_a_time(systems[name], prompts)
        together = _together(systems[name], prompts)
        report[f"{name}_{len(prompts)}_vs_1"] = together / alone
        report[f"{name}_1_client_tok_s"], report[f"{name}_{len(prompts)}_clients_tok_s"] = alone, together
    print(f"{args.export}: {n} new tokens, {args.rounds} rounds, {args.threads} threads, max_batch {args.max_batch}")
    print(f"tokens generated per system: {report['tokens']}")
    for key, value in report.items():
        if isinstance(value, float):
            print(f"  {key:<40} {value:8.2f}")
    for server, _, _ in servers:
        server.terminate()
        server.wait(timeout=30)
    for scheduler in schedulers:
        scheduler.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
