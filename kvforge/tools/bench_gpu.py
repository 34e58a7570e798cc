"""`kvforge bench EXPORT --backend ort-cuda` (or tensorrt): time to first token, decode tokens/s and GPU
memory at each batch size, against Hugging Face on the same GPU.

Peers (`--compare`): `hf`, Hugging Face eager `generate` in the export's dtype; `hf-compiled`, the same
with a static KV cache, with which `generate` compiles its decoding forward, here under
`torch.compile(mode="reduce-overhead", fullgraph=True)`: the CUDA-graph setup a GPU user tries first
(transformers' own recipe for fast generation; the prefill stays eager). Both see the
same prompt ids as kvforge (rows of different lengths, left-padded for Hugging Face), greedy, and
generate exactly `new_tokens` per row.

Each system runs in its own process (GPU memory is its own: the device's memory in use after the runs,
CUDA context included, measured the same way for every system), warms up (sessions, CUDA graphs, torch
compilation) on the very request it then times, and times it `repeat` times; medians are reported.
Hugging Face's time to first token is when `generate` hands its streamer the first token (after the
prefill, the first pick and its copy to the host); kvforge's is the Generator's own. Each decode figure
comes with its share of the bandwidth limit (kvforge/tools/bandwidth.py): the bytes a step reads over
the step's time, against the GPU's datasheet bandwidth by its name (or `mem_bandwidth`).

Worker mode: python -m kvforge.tools.bench_gpu worker SYSTEM PATH PROMPT_LEN NEW BATCHES REPEAT BACKEND OPTIONS_JSON
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError
from kvforge.core.manifest import load_manifest
from kvforge.tools.bandwidth import (
    bytes_per_decode_step,
    gpu_bandwidth_choice,
    mean_context,
    parse_mem_bandwidth,
    share_pct,
)
from kvforge.tools.bench_workers import check_fits, prompt_ids, row_lengths

GPU_BACKENDS = ("ort-cuda", "tensorrt")
GPU_PEERS = ("hf", "hf-compiled")
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def prompt_rows(prompt_len: int, batch: int, vocab: int) -> list[list[int]]:
    return [prompt_ids(n, b, vocab) for b, n in enumerate(row_lengths(prompt_len, batch))]


def gpu_memory_mb() -> float | None:
    """The GPU's memory in use (MB), through cuda-python, else nvidia-smi; None where neither answers."""
    try:
        from kvforge.core import cuda

        free, total = cuda.memory_info()
        return (total - free) / 1e6
    except Exception:  # no cuda-python: ask nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return float(out.stdout.split()[0]) * 1.048576 if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _median_row(samples: list[dict[str, float]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for metric in samples[0]:
        values = [s[metric] for s in samples]
        row[metric] = statistics.median(values)
        row[f"{metric}_spread"] = [min(values), max(values)]
    return row


# -- workers (one process each) ---------------------------------------------------------------------
def _work_kvforge(path: str, prompt_len: int, new: int, batches: list[int], repeat: int, backend: str,
                  options: dict[str, Any]) -> dict[str, Any]:
    from kvforge.runtime import GenerationRequest, Generator

    gen = Generator(path, backend=backend, **options)
    out: dict[str, Any] = {"batches": {}, "tokens": {}}
    for batch in batches:
        request = GenerationRequest(prompt_rows(prompt_len, batch, gen.vocab_size), new, ignore_eos=True)  # greedy
        first = gen.generate(request)  # warm-up: the same shapes, so the same slot, bindings and CUDA graph
        samples = []
        for _ in range(repeat):
            result = gen.generate(request)
            samples.append({"ttft_ms": result.ttft_ms, "decode_tokens_per_s": result.decode_tokens_per_s,
                            "step_ms": result.decode_ms / max(result.steps, 1)})
        out["batches"][str(batch)] = _median_row(samples)
        out["tokens"][str(batch)] = first.tokens
    out["cuda_graphs"] = bool(getattr(gen.backend, "cuda_graphs", False))
    out["cuda_graphs_refused"] = getattr(gen.backend, "cuda_graphs_refused", None)
    out["device_greedy"] = bool(getattr(gen.backend, "device_greedy", False))
    out["device_greedy_refused"] = getattr(gen.backend, "device_greedy_refused", None)
    out["pick_graph"] = getattr(getattr(gen.backend, "picker", None), "cuda_graphs", None)
    out["decode_attention"] = getattr(gen.backend, "decode_attention", None)
    return out


class _FirstToken:
    """A `generate` streamer that notes when the first generated token arrives (its first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _work_hf(path: str, prompt_len: int, new: int, batches: list[int], repeat: int, backend: str,
             options: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, options["dtype"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    if options.get("compiled"):
        # transformers' recipe: a static cache (fixed shapes), with which `generate` compiles the decoding
        # forward, here with CUDA graphs (reduce-overhead) over the whole graph; the prefill stays eager.
        from transformers import CompileConfig

        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    vocab = model.config.vocab_size
    out: dict[str, Any] = {"batches": {}, "tokens": {}}
    for batch in batches:
        rows = prompt_rows(prompt_len, batch, vocab)
        _, tokens = _hf_run(model, rows, new)  # warm-up (and, compiled, the compilation of both phases)
        _hf_run(model, rows, new)
        out["batches"][str(batch)] = _median_row([_hf_run(model, rows, new)[0] for _ in range(repeat)])
        out["tokens"][str(batch)] = tokens
    return out


def _hf_run(model: Any, rows: list[list[int]], new: int) -> tuple[dict[str, float], list[list[int]]]:
    """One timed greedy `generate` of `new` tokens per row: its timings and the generated ids."""
    import torch

    batch, width = len(rows), max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    streamer = _FirstToken()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, streamer=streamer, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    end = time.perf_counter()
    assert streamer.first is not None
    return ({"ttft_ms": (streamer.first - start) * 1e3,
             "decode_tokens_per_s": batch * (new - 1) / (end - streamer.first),
             "step_ms": (end - streamer.first) * 1e3 / (new - 1)},
            generated[:, width:].tolist())


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {"kvforge": _work_kvforge, "hf": _work_hf, "hf-compiled": _work_hf}


def _worker_main(argv: list[str]) -> None:
    system, path, prompt_len, new, batches, repeat, backend, options = argv
    result = WORKERS[system](path, int(prompt_len), int(new), [int(b) for b in batches.split(",")], int(repeat),
                             backend, json.loads(options))
    result["gpu_memory_mb"] = gpu_memory_mb()
    print(json.dumps(result))


# -- the orchestrator -------------------------------------------------------------------------------
def run_gpu_bench(export_dir: str | Path, backend: str, batches: tuple[int, ...] = (1, 8), prompt_len: int = 128,
                  new_tokens: int = 128, repeat: int = 5, compare: tuple[str, ...] = (),
                  say: Callable[[str], None] | None = None, backend_options: dict[str, Any] | None = None,
                  worker_timeout: float | None = None, mem_bandwidth: float | None = None) -> dict[str, Any]:
    """The report (see the module docstring). kvforge's failure fails the run; a peer that fails or runs
    past `worker_timeout` seconds is reported with its error, beside the figures of the others.
    `mem_bandwidth` (GB/s): the bandwidth the decode shares are taken of, instead of the GPU's table figure."""
    say = say or (lambda _msg: None)
    mem_bandwidth = parse_mem_bandwidth(mem_bandwidth)
    if backend not in GPU_BACKENDS:
        raise InputError(f"the GPU benchmark runs backend {', '.join(GPU_BACKENDS)}; got {backend!r}")
    unknown = sorted(set(compare) - set(GPU_PEERS))
    if unknown:
        raise InputError(f"--compare with --backend {backend} takes {', '.join(GPU_PEERS)}; got {', '.join(unknown)}")
    for name, value, low in (("--prompt-len", prompt_len, 4), ("--new-tokens", new_tokens, 2), ("--repeat", repeat, 1)):
        if value < low:
            raise InputError(f"{name} must be >= {low}, got {value}")
    if not batches or min(batches) < 1:
        raise InputError(f"--batch takes positive sizes, got {batches}")
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    check_fits(manifest, prompt_len, new_tokens)
    source = Path(manifest["model"].get("source", ""))
    systems = {"kvforge": (str(export_dir), dict(backend_options or {}))}
    dtype = TORCH_DTYPES.get(manifest["dtype"], "float16")
    for peer in compare:
        if not (source / "config.json").is_file():
            raise InputError(f"--compare {peer} needs the export's source folder {source}, which is gone")
        systems[peer] = (str(source), {"dtype": dtype, "compiled": peer == "hf-compiled"})
    results: dict[str, dict[str, Any]] = {}
    for name, (path, options) in systems.items():
        say(f"{name}: batches {', '.join(map(str, batches))}, {repeat} timed runs each after a warm-up")
        command = [sys.executable, "-m", "kvforge.tools.bench_gpu", "worker", name, path, str(prompt_len), str(new_tokens),
                   ",".join(map(str, batches)), str(repeat), backend, json.dumps(options)]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=worker_timeout)
            failure = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            failure = f"still running after {worker_timeout:.0f} s; stopped"
        if failure is not None:
            if name == "kvforge":
                raise InputError(f"the kvforge benchmark process failed: {failure}")
            say(f"{name}: failed: {failure}")
            results[name] = {"error": failure, "batches": {}, "tokens": {}}
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    _peer_ratios(results)
    gpu = _gpu_name()
    bandwidth = gpu_bandwidth_choice(mem_bandwidth, gpu)
    reads = _decode_shares(results, manifest, export_dir, prompt_len, new_tokens, bandwidth["mem_bandwidth_gbps"])
    return {"export": str(export_dir), "backend": backend, "dtype": manifest["dtype"], "prompt_len": prompt_len,
            "new_tokens": new_tokens, "batches": list(batches), "repeat": repeat, "gpu": gpu, **bandwidth,
            "bytes_per_decode_step": reads, "systems": results}


def _peer_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Each peer's rows get kvforge's ratios over them and whether their tokens equal kvforge's."""
    ours = results["kvforge"]
    for name, result in results.items():
        if name == "kvforge" or "error" in result:
            continue
        for batch, row in result["batches"].items():
            mine = ours["batches"][batch]
            row["decode_ratio_kvforge_over_peer"] = mine["decode_tokens_per_s"] / row["decode_tokens_per_s"]
            row["ttft_ratio_kvforge_over_peer"] = mine["ttft_ms"] / row["ttft_ms"]
            # Greedy on both sides: the same tokens, except where fp16 rounding flips a near tie.
            row["tokens_equal_kvforge"] = result["tokens"][batch] == ours["tokens"][batch]
    for result in results.values():
        result.pop("tokens")


def _decode_shares(results: dict[str, dict[str, Any]], manifest: dict[str, Any], export_dir: Path, prompt_len: int,
                   new_tokens: int, gbps: float | None) -> dict[str, dict[str, Any]]:
    """Each row's bytes read per decode step and its share of the bandwidth limit (None without a bandwidth).
    Hugging Face runs the source model in the export's dtype: the same weight elements at that size. Returns
    kvforge's bytes per step by batch."""
    reads: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        for batch, row in result["batches"].items():
            context = mean_context(row_lengths(prompt_len, int(batch)), new_tokens)
            step = bytes_per_decode_step(manifest, export_dir, int(batch), context,
                                         dtype=None if name == "kvforge" else manifest["dtype"])
            if name == "kvforge":
                reads[batch] = step
            row["bytes_per_decode_step"] = step["total_bytes"]
            row["decode_read_gbps"] = step["total_bytes"] / (row["step_ms"] / 1e3) / 1e9
            row["decode_share_of_bandwidth_limit_pct"] = share_pct(step["total_bytes"], row["step_ms"], gbps)
    return reads


def _gpu_name() -> str | None:
    from kvforge.tools.doctor import gpus

    found, _ = gpus()
    return found[0]["name"] if found else None


def format_gpu_table(report: dict[str, Any]) -> str:
    lines = [f"{report['export']} on {report['gpu'] or 'a GPU'} ({report['backend']}, {report['dtype']}): prompt "
             f"{report['prompt_len']}, {report['new_tokens']} new tokens, median of {report['repeat']} runs",
             f"{'system':<14}{'batch':>6}{'TTFT ms':>10}{'decode tok/s':>14}{'% of BW limit':>15}{'GPU MB':>9}"
             "   ratios kvforge/peer (decode >1: kvforge faster; TTFT <1: kvforge sooner)"]
    for name, result in report["systems"].items():
        if "error" in result:
            lines.append(f"{name:<14}failed: {result['error']}")
            continue
        memory = result.get("gpu_memory_mb")
        for batch, row in result["batches"].items():
            ratios = "" if name == "kvforge" else (
                f"   decode x{row['decode_ratio_kvforge_over_peer']:.2f}, TTFT x{row['ttft_ratio_kvforge_over_peer']:.2f}"
                f"{'' if row['tokens_equal_kvforge'] else ' (tokens differ)'}")
            share = row.get("decode_share_of_bandwidth_limit_pct")
            lines.append(f"{name:<14}{batch:>6}{row['ttft_ms']:>10.2f}{row['decode_tokens_per_s']:>14.0f}"
                         f"{'-' if share is None else f'{share:.1f}%':>15}"
                         f"{memory if memory is not None else float('nan'):>9.0f}{ratios}")
    graphs = report["systems"]["kvforge"].get("cuda_graphs")
    picks = "greedy picks on the device" if report["systems"]["kvforge"].get("device_greedy") else "picks on the host"
    lines.append(f"kvforge decode steps {'replayed from CUDA graphs' if graphs else 'run without CUDA graphs'}, {picks}; "
                 "GPU MB: the device's memory in use after the runs (CUDA context included)")
    lines.append(_bandwidth_line(report))
    return "\n".join(lines)


def _bandwidth_line(report: dict[str, Any]) -> str:
    """What the "% of BW limit" column divides (or why it is empty)."""
    if report.get("mem_bandwidth_gbps") is None:
        return f"% of BW limit: not computed, {report.get('mem_bandwidth_note') or 'no bandwidth known'}"
    reads = "; ".join(f"batch {batch}: {r['weights_bytes'] / 1e6:,.2f} MB of weights + {r['kv_bytes'] / 1e6:,.2f} MB of "
                      f"KV cache" for batch, r in report.get("bytes_per_decode_step", {}).items())
    return (f"% of BW limit = bytes read per decode step / step time / {report['mem_bandwidth_gbps']:.0f} GB/s "
            f"({report['mem_bandwidth_source']}); kvforge reads per step at the decode's mean context {reads}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        _worker_main(sys.argv[2:])
