"""Load benchmark for `kvforge serve`: N concurrent clients (the real `openai` client) against one
server on a loopback port, compared in the same run with the same requests sent one at a time.

    python benchmarks/bench_serve.py --export /tmp/b9/sm-fp32 --requests 32 --clients 8 --max-tokens 64

Prints (and with --json writes) aggregate decode tokens/s, time to first token p50/p99 and
inter-token latency for both modes, and their ratio. Random-weight exports may stop early at EOS,
so token counts are measured, not assumed.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(base: str, model: str, prompt: list[int] | str, max_tokens: int, extra: dict | None = None) -> dict[str, float]:
    """One streamed completion; `extra`: more body fields (extensions such as ignore_eos)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    stamps = []
    tokens = prompt_tokens = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices and chunk.choices[0].finish_reason is None:  # one chunk per generated token
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft_s": (stamps[0] if stamps else end) - start, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "seconds": end - start, "itl_s": statistics.median(gaps) if gaps else 0.0, "gaps_s": gaps}


def _mode(base: str, model: str, prompts: list[list[int]] | list[str], max_tokens: int, clients: int,
          extra: dict | None = None) -> dict[str, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda p: _one(base, model, p, max_tokens, extra), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft_s"] for r in runs)
    gaps = sorted(g for r in runs for g in r["gaps_s"]) or [0.0]  # every request's gaps: stalls show in the tail
    return {"clients": clients, "requests": len(runs), "tokens": sum(r["tokens"] for r in runs),
            "prompt_tokens": [r["prompt_tokens"] for r in runs], "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2], "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "itl_median_ms": 1e3 * statistics.median(r["itl_s"] for r in runs),
            "itl_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    port = _free_port()
    # The server runs in its own process (as `kvforge serve`), so the clients' Python does not
    # compete with the scheduler thread for the GIL.
    server = subprocess.Popen([sys.executable, "-c", "from kvforge.cli import main; main()", "serve", args.export,
                               "--port", str(port), "--max-batch", str(args.clients), "--threads", str(args.threads),
                               "--max-seq-len", str(args.prompt_len + args.max_tokens + 8)])
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if server.poll() is not None:
                raise SystemExit("kvforge serve exited") from None
            time.sleep(0.2)
    vocab = json.loads((Path(args.export) / "kvforge.json").read_text())["model"]["vocab_size"]
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = [[(7 + 31 * i + 13 * t) % (vocab - 10) + 5 for t in range(args.prompt_len)] for i in range(args.requests)]
    _mode(base, model, prompts[:2], 4, 1)  # warm-up
    sequential = _mode(base, model, prompts, args.max_tokens, 1)
    concurrent = _mode(base, model, prompts, args.max_tokens, args.clients)
    report = {"export": args.export, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "one_at_a_time": sequential, "concurrent": concurrent,
              "throughput_ratio": concurrent["tokens_per_s"] / sequential["tokens_per_s"]}
    for name in ("one_at_a_time", "concurrent"):
        r = report[name]
        print(f"{name:<14} {r['clients']} clients: {r['requests']} requests, {r['tokens']} tokens in {r['wall_s']:.1f} s "
              f"= {r['tokens_per_s']:.1f} tok/s; TTFT p50 {r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms; "
              f"inter-token {r['itl_median_ms']:.1f} ms")
    print(f"aggregate tokens/s, concurrent / one at a time: x{report['throughput_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    server.terminate()
    server.wait(timeout=30)


if __name__ == "__main__":
    main()
