"""Serving throughput of `kvforge serve` against llama.cpp's own server (`llama-server --parallel N`) on
the same model, at several numbers of concurrent clients.

    python benchmarks/bench_serving_peer.py --kvforge kvforge-demo/smollm2-135m-instruct-ort \\
        --gguf /tmp/peer/smollm2-135m-instruct-f32.gguf --llama-server /tmp/peer/llbuild/bin/llama-server \\
        --clients 1,4,8,16 --max-tokens 64 --json benchmarks/results/serving_peer_fp32.json

For each client count N both servers are started fresh on loopback ports, with N batch rows
(`kvforge serve --max-batch N`, `llama-server --parallel N`, N slots of --max-seq-len positions
each) and the same threads, and warmed up; then they take turns (--repeats R: A B, B A, ...; the
server that goes first alternates from one N to the next), so the machine's load falls on both
alike, and each metric is the median of its R samples. The same text prompts (pieces of
benchmarks/data/passage.txt, each starting at another word, new ones for every repeat, so no prompt
prefix is ever cached) go through the real `openai` client, streamed, greedy, `ignore_eos` on both
servers so every answer is max_tokens long. Reported per server and N: aggregate generated tokens/s, time to first token p50/p99
and inter-token latency (median over requests of each request's median gap, and the p99 of all gaps:
stalls show there); the prompt token counts
each server reports are compared (same tokenizer, so they must match).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from bench_serve import _free_port, _mode

PASSAGE = Path(__file__).parent / "data" / "passage.txt"
SIDES = ("kvforge", "llama.cpp")


def text_prompts(count: int, words: int, passage: Path = PASSAGE) -> list[str]:
    """`count` prompts of `words` words each: the passage (repeated as needed) read from a different
    word each time, so that no two prompts share a first word's prefix."""
    text = passage.read_text().split()
    step = max(1, len(text) // count)
    return [" ".join((text * (2 + words // len(text)))[i * step % len(text):][:words]) for i in range(count)]


def kvforge_command(export: str, port: int, clients: int, threads: int, seq_len: int) -> list[str]:
    return [sys.executable, "-c", "from kvforge.cli import main; main()", "serve", export, "--port", str(port),
            "--max-batch", str(clients), "--threads", str(threads), "--max-seq-len", str(seq_len), "--log-format", "off"]


def llama_command(binary: str, gguf: str, port: int, clients: int, threads: int, seq_len: int,
                  extra: Sequence[str] = ()) -> list[str]:
    # -c is split between the --parallel slots (no unified KV cache with an explicit --parallel).
    return [binary, "-m", gguf, "--port", str(port), "--parallel", str(clients), "-c", str(clients * seq_len),
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui", *extra]


def start(command: list[str], base: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The server process, once its /health answers 200 (llama-server: 503 while it loads)."""
    with log.open("ab") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"{command[0]} exited with {server.returncode}; see {log}")
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"{command[0]} did not become healthy in 300 s; see {log}")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_median_ms", "itl_p99_ms")


def sample(base: str, model: str, prompts: list[str], max_tokens: int, clients: int) -> dict:
    """One measurement: `prompts` from `clients` concurrent clients, with the 1-minute load average
    before and after."""
    load = os.getloadavg()[0]
    result = _mode(base, model, prompts, max_tokens, clients, {"ignore_eos": True})
    result["load_avg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return result


def combine(samples: list[dict]) -> dict:
    """The median of each metric over the repeats, the lowest and highest load, every prompt's token
    count, and the samples."""
    out = {k: statistics.median(s[k] for s in samples) for k in METRICS}
    out.update({k: samples[0][k] for k in ("clients", "requests", "tokens")})
    out["all_same_lengths"] = all(s["tokens"] == samples[0]["tokens"] for s in samples)
    out["prompt_tokens"] = [n for s in samples for n in s["prompt_tokens"]]  # every repeat's prompts, in order
    out["load_avg_1m"] = [min(s["load_avg_1m"][0] for s in samples), max(s["load_avg_1m"][1] for s in samples)]
    out["samples"] = samples
    return out


def table(runs: list[dict]) -> str:
    """A Markdown table: one row per client count, kvforge and llama.cpp side by side, and their ratio
    of aggregate tokens/s."""
    lines = ["| clients | server | tokens/s | TTFT p50 / p99 ms | inter-token median / p99 ms | load avg 1m |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        for side in SIDES:
            r = run[side]
            lines.append(f"| {run['clients']} | {side} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / "
                         f"{r['ttft_p99_ms']:.0f} | {r['itl_median_ms']:.1f} / {r['itl_p99_ms']:.0f} | "
                         f"{r['load_avg_1m'][0]:.1f}-{r['load_avg_1m'][1]:.1f} |")
        ratio = run["kvforge"]["tokens_per_s"] / run["llama.cpp"]["tokens_per_s"]
        lines.append(f"| {run['clients']} | kvforge / llama.cpp | x{ratio:.2f} | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvforge", required=True, help="kvforge export folder")
    parser.add_argument("--gguf", required=True, help="the same model as a GGUF file")
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--clients", default="1,4,8,16", help="comma-separated concurrent client counts")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests = max(this x N, 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-seq-len", type=int, default=256, help="positions per request (slot)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0'")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per server and N, taking turns")
    parser.add_argument("--first", choices=SIDES, default=SIDES[0], help="the server that goes first at the first N")
    parser.add_argument("--llama-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for llama-server, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    parser.add_argument("--log-dir", default="/tmp", help="the servers' output goes to files here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    most = max(max(args.requests_per_client * n, 8) for n in counts)
    # Each repeat sends other prompts, so no server answers a prompt it has cached.
    all_prompts = text_prompts(4 + most * args.repeats, args.prompt_words)
    warm, prompts = all_prompts[:4], all_prompts[4:]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = []
    for i, clients in enumerate(counts):
        count = max(args.requests_per_client * clients, 8)
        run: dict = {"clients": clients}
        servers, bases, models, commands = {}, {}, {}, {}
        try:
            for side in SIDES:  # both up at once: an idle server waits on a queue, so they can take turns
                port = _free_port()
                command = (kvforge_command(args.kvforge, port, clients, args.threads, args.max_seq_len)
                           if side == "kvforge" else
                           llama_command(args.llama_server, args.gguf, port, clients, args.threads, args.max_seq_len,
                                         args.llama_args.split()))
                env = {} if side == "kvforge" else dict(item.split("=", 1) for item in args.llama_env)
                bases[side] = f"http://127.0.0.1:{port}"
                servers[side] = start(command, bases[side], Path(args.log_dir) / f"bench_serving_peer_{side.replace('.', '')}.log",
                                      env)
                models[side] = httpx.get(f"{bases[side]}/v1/models", timeout=10).json()["data"][0]["id"]
                commands[side] = " ".join([f"{k}={v}" for k, v in env.items()]
                                          + (["kvforge", *command[3:]] if side == "kvforge" else command))
                _mode(bases[side], models[side], warm, 8, min(clients, len(warm)), {"ignore_eos": True})  # warm-up
            order = SIDES if (i + (args.first == SIDES[1])) % 2 == 0 else SIDES[::-1]
            samples: dict[str, list[dict]] = {side: [] for side in SIDES}
            for repeat in range(args.repeats):  # A B, then B A, ...
                for side in order if repeat % 2 == 0 else order[::-1]:
                    requests = prompts[repeat * count:(repeat + 1) * count]
                    r = sample(bases[side], models[side], requests, args.max_tokens, clients)
                    samples[side].append(r)
                    print(f"{clients:>2} clients {side:<9}: {r['requests']} requests, {r['tokens']} tokens in "
                          f"{r['wall_s']:.1f} s = {r['tokens_per_s']:.1f} tok/s; TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                          f"p99 {r['ttft_p99_ms']:.0f} ms; inter-token {r['itl_median_ms']:.1f} ms "
                          f"(p99 {r['itl_p99_ms']:.0f}); load {r['load_avg_1m']}", flush=True)
        finally:
            for server in servers.values():
                stop(server)
        for side in SIDES:
            run[side] = {**combine(samples[side]), "command": commands[side]}
        run["prompt_tokens_match"] = run["kvforge"]["prompt_tokens"] == run["llama.cpp"]["prompt_tokens"]
        run["all_max_tokens"] = all(run[s]["tokens"] == run[s]["requests"] * args.max_tokens and run[s]["all_same_lengths"]
                                    for s in SIDES)
        runs.append(run)
    print(table(runs))
    for run in runs:
        if not (run["prompt_tokens_match"] and run["all_max_tokens"]):
            print(f"WARNING {run['clients']} clients: prompt tokens match {run['prompt_tokens_match']}, "
                  f"every answer {args.max_tokens} tokens {run['all_max_tokens']}")
    if args.json:
        report = {"kvforge": args.kvforge, "gguf": args.gguf, "max_tokens": args.max_tokens,
                  "prompt_words": args.prompt_words, "threads": args.threads, "max_seq_len": args.max_seq_len,
                  "repeats": args.repeats, "cpus": os.cpu_count(), "started": started, "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
