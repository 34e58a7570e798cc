"""Benchmark the fused Triton attention kernel against torch SDPA on a CUDA GPU.

    python benchmarks/bench_attention_kernel.py [--json FILE] [--quick]

Every config is first checked against the torch reference (fp32 eager, plugins/reference.py) and the
max error printed; then the kernel and SDPA are timed with triton.testing.do_bench (median, L2
flushed between runs) and with triton.testing.do_bench_cudagraph (median, "GPU" columns): the
Python launcher costs tens of microseconds per call, more than a short decode kernel runs, and a
TensorRT plugin does not pay it, so the graph figures are the kernel's own time. Configs: prefill S = 512..4096 (B=1) and decode over caches of 1k..32k
(B=1 and B=8), H=32, Hkv=8, D=128, fp16 and bf16.

SDPA baselines (the faster of the two is the ratio's denominator):
- `enable_gqa=True` on the unexpanded K/V;
- K/V pre-expanded to all query heads outside the timed region (repeat_interleave), which flatters
  SDPA on decode since the expansion is not paid.
For decode SDPA attends the first past_len + 1 cache rows; for prefill it is causal over the S new
tokens. SDPA does not write the cache; the kernel appends the new K/V rows in the same launch.
Decode bandwidth = bytes of K/V cache read + q, out, the new K/V rows read and written, / time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from kvforge.core.contract import AttentionAttrs

H, HKV, D = 32, 8, 128
PREFILL_SEQS = (512, 1024, 2048, 4096)
DECODE_CAPACITIES = (1024, 4096, 8192, 16384, 32768)
DECODE_BATCHES = (1, 8)
DTYPES = ("float16", "bfloat16")
# Max |kernel - fp32 reference| accepted in the correctness pass (about two output ulps).
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2}


def _configs(quick: bool) -> list[dict]:
    configs = []
    for dtype in DTYPES:
        for seq in PREFILL_SEQS[:2] if quick else PREFILL_SEQS:
            configs.append(
                {"kind": "prefill", "dtype": dtype, "batch": 1, "seq": seq, "capacity": seq, "past": 0}
            )
        for batch in DECODE_BATCHES:
            for cap in DECODE_CAPACITIES[:2] if quick else DECODE_CAPACITIES:
                configs.append(
                    {
                        "kind": "decode",
                        "dtype": dtype,
                        "batch": batch,
                        "seq": 1,
                        "capacity": cap,
                        "past": cap - 1,
                    }
                )
    return configs


def _label(c: dict) -> str:
    size = f"S={c['seq']}" if c["kind"] == "prefill" else f"C={c['capacity'] // 1024}k"
    return f"{c['kind']:<7} {c['dtype']:<8} B={c['batch']} {size}"


def _inputs(c: dict, torch, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, c["dtype"])
    b, s, cap = c["batch"], c["seq"], c["capacity"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    return {
        "q": rand(b, s, H * D),
        "k": rand(b, s, HKV * D),
        "v": rand(b, s, HKV * D),
        "past_key": rand(b, HKV, cap, D),
        "past_value": rand(b, HKV, cap, D),
        "past_lens": torch.full((b,), c["past"], dtype=torch.int32, device="cuda"),
    }


def _check(c: dict, torch, kernel, reference) -> float:
    x = _inputs(c, torch, seed=1)
    scale = 1.0 / math.sqrt(D)
    # fp32 eager reference on fp32 copies of the same (rounded) inputs.
    ref_out, ref_key, _ = reference(
        *(t.float() if t.is_floating_point() else t for t in x.values()), AttentionAttrs(H, HKV, scale)
    )
    key, value = x["past_key"].clone(), x["past_value"].clone()
    out = kernel(x["q"], x["k"], x["v"], key, value, x["past_lens"], AttentionAttrs(H, HKV, scale))
    torch.cuda.synchronize()
    if not torch.equal(key.float(), ref_key):
        return float("inf")
    return float((out.float() - ref_out).abs().max())


def _bench_one(c: dict, torch, triton, kernel) -> dict:
    F = torch.nn.functional
    x = _inputs(c, torch)
    scale = 1.0 / math.sqrt(D)
    b, s, past = c["batch"], c["seq"], c["past"]
    key, value, lens = x["past_key"], x["past_value"], x["past_lens"]

    attrs = AttentionAttrs(H, HKV, scale)

    def run_kernel():
        return kernel(x["q"], x["k"], x["v"], key, value, lens, attrs)

    q4 = x["q"].view(b, s, H, D).transpose(1, 2)
    if c["kind"] == "prefill":
        k4 = x["k"].view(b, s, HKV, D).transpose(1, 2)
        v4 = x["v"].view(b, s, HKV, D).transpose(1, 2)
        causal = True
    else:
        k4, v4 = key[:, :, : past + 1], value[:, :, : past + 1]
        causal = False
    k_rep, v_rep = k4.repeat_interleave(H // HKV, 1), v4.repeat_interleave(H // HKV, 1)

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale, enable_gqa=True)

    def sdpa_expanded():
        return F.scaled_dot_product_attention(q4, k_rep, v_rep, is_causal=causal, scale=scale)

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    def graph(fn):
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")

    t_kernel, t_gqa, t_exp = bench(run_kernel), bench(sdpa_gqa), bench(sdpa_expanded)
    t_sdpa = min(t_gqa, t_exp)
    row = {**c, "kernel_ms": t_kernel, "sdpa_gqa_ms": t_gqa, "sdpa_expanded_ms": t_exp}
    row["speedup_vs_sdpa"] = t_sdpa / t_kernel
    g_kernel, g_sdpa = graph(run_kernel), min(graph(sdpa_gqa), graph(sdpa_expanded))
    row.update({"kernel_gpu_ms": g_kernel, "sdpa_gpu_ms": g_sdpa, "gpu_speedup_vs_sdpa": g_sdpa / g_kernel})
    elt = 2
    if c["kind"] == "decode":
        cache_read = 2 * b * HKV * (past + 1) * D * elt
        other = 2 * b * H * D * elt + 2 * 2 * b * HKV * D * elt  # q + out, new k/v read + written
        row["kernel_GBps"] = (cache_read + other) / (t_kernel * 1e-3) / 1e9
        row["kernel_gpu_GBps"] = (cache_read + other) / (g_kernel * 1e-3) / 1e9
        row["sdpa_gpu_GBps"] = (cache_read + 2 * b * H * D * elt) / (g_sdpa * 1e-3) / 1e9
    else:
        flops = 4 * b * H * s * s * D / 2  # causal: half of QK^T and PV
        row["kernel_TFLOPs"] = flops / (t_kernel * 1e-3) / 1e12
        row["kernel_gpu_TFLOPs"] = flops / (g_kernel * 1e-3) / 1e12
        row["sdpa_gpu_TFLOPs"] = flops / (g_sdpa * 1e-3) / 1e12
    return row


def _perf(r: dict) -> str:
    if r["kind"] == "decode":
        return f"{r['kernel_gpu_GBps']:.0f} GB/s"
    return f"{r['kernel_gpu_TFLOPs']:.0f} TFLOP/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    args = parser.parse_args(argv)

    try:
        import torch
        import triton
        import triton.testing  # noqa: F401
    except ImportError as exc:
        print(f"bench_attention_kernel: needs torch and triton ({exc})")
        return 0
    if not torch.cuda.is_available():
        print("bench_attention_kernel: no CUDA GPU present; nothing to benchmark")
        return 0

    from kvforge.plugins.reference import kv_cache_attention
    from kvforge.plugins.triton_attention import kv_cache_attention_triton

    def kernel(*a):
        return kv_cache_attention_triton(*a, interpret=False)

    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    configs = _configs(args.quick)

    print("correctness (max |kernel - fp32 reference|):", flush=True)
    failures = 0
    for c in configs:
        t0 = time.perf_counter()
        err = _check(c, torch, kernel, kv_cache_attention)
        ok = err <= TOLERANCE[c["dtype"]]
        failures += not ok
        c["max_error"] = err
        print(
            f"  {_label(c)}: {err:.2e} {'ok' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f}s)", flush=True
        )
        torch.cuda.empty_cache()

    print("timing (medians; GPU = CUDA graph replay, no launcher overhead):", flush=True)
    rows = []
    for c in configs:
        row = _bench_one(c, torch, triton, kernel)
        rows.append(row)
        print(
            f"  {_label(c)}: kernel {row['kernel_ms']:.4f} ms (GPU {row['kernel_gpu_ms']:.4f}), SDPA gqa "
            f"{row['sdpa_gqa_ms']:.4f} / expanded {row['sdpa_expanded_ms']:.4f} ms (GPU {row['sdpa_gpu_ms']:.4f}), "
            f"{_perf(row)}",
            flush=True,
        )
        torch.cuda.empty_cache()

    print(
        f"\n{'config':<30} {'kernel ms':>9} {'SDPA ms':>8} {'x':>5} {'GPU ms':>8} {'SDPA GPU':>8} "
        f"{'x GPU':>5}  {'kernel (GPU time)':<18} {'max err':>7}"
    )
    for r in rows:
        sdpa = min(r["sdpa_gqa_ms"], r["sdpa_expanded_ms"])
        print(
            f"{_label(r):<30} {r['kernel_ms']:>9.4f} {sdpa:>8.4f} {r['speedup_vs_sdpa']:>5.2f} "
            f"{r['kernel_gpu_ms']:>8.4f} {r['sdpa_gpu_ms']:>8.4f} {r['gpu_speedup_vs_sdpa']:>5.2f}  "
            f"{_perf(r):<18} {r['max_error']:>7.1e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device, "torch": torch.__version__, "triton": triton.__version__, "results": rows},
                f,
                indent=1,
            )
    if failures:
        print(f"{failures} config(s) failed the correctness check")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
