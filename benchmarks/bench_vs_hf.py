"""Decode tokens/s and time to first token: kvforge (ONNX Runtime CPU) vs Hugging Face eager.

Both run in this one process on the same machine, one after the other, same thread count, same
prompt, greedy, EOS ignored. Speeds are reported as measured and as a ratio: this machine is
shared and noisy, so only the ratio within one run means much.

    python benchmarks/bench_vs_hf.py --recipe smollm2-135m-shape --prompt-tokens 128 --new-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def hf_eager(model_dir: Path, prompt: list[int], new_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        ttft = time.perf_counter() - start
        tokens = [int(token)]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
        decode = time.perf_counter() - start
    return {"ttft_ms": ttft * 1e3, "decode_tokens_per_s": (new_tokens - 1) / decode, "tokens": tokens}


def kvforge_ort(export_dir: Path, prompt: list[int], new_tokens: int, threads: int, sessions: str) -> dict:
    from kvforge.runtime import Generator

    generator = Generator(export_dir, threads=threads, sessions=sessions)
    generator.generate([prompt], max_new_tokens=4, greedy=True, ignore_eos=True)  # warm-up
    result = generator.generate([prompt], max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    return {"ttft_ms": result.ttft_ms, "decode_tokens_per_s": result.decode_tokens_per_s, "tokens": result.tokens[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="smollm2-135m-shape")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side; the median is reported")
    parser.add_argument("--target", default="ort", choices=["ort", "onnx"])
    parser.add_argument("--workdir", type=Path, help="keep the model and export here (default: a temp dir)")
    args = parser.parse_args()

    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import materialize

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvforge-bench-"))
    model_dir, export_dir = work / args.recipe, work / f"{args.recipe}-{args.target}"
    if not model_dir.exists():
        materialize(args.recipe, model_dir)
    if not export_dir.exists():
        export_model(model_dir, export_dir, target=args.target, progress=lambda m: print(f"[export] {m}", flush=True))
    rng = np.random.default_rng(0)
    prompt = [1] + rng.integers(4, 2000, size=args.prompt_tokens - 1).tolist()

    # The runtime's three ways of holding the weights (Generator(sessions=...)), see README.
    modes = {"kvforge_single": "single", "kvforge_shared": "shared", "kvforge_separate": "separate"}
    runs: dict[str, list[dict]] = {"hf_eager": [], **{name: [] for name in modes}}
    for _ in range(args.repeats):  # interleaved so that machine noise hits every side alike
        runs["hf_eager"].append(hf_eager(model_dir, prompt, args.new_tokens, args.threads))
        for name, mode in modes.items():
            runs[name].append(kvforge_ort(export_dir, prompt, args.new_tokens, args.threads, mode))
    summary = {}
    for name, items in runs.items():
        summary[name] = {
            "ttft_ms": round(statistics.median(r["ttft_ms"] for r in items), 2),
            "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in items), 2),
        }
    hf = summary["hf_eager"]
    for name in modes:
        summary[name]["decode_speedup_vs_hf"] = round(summary[name]["decode_tokens_per_s"] / hf["decode_tokens_per_s"], 2)
        summary[name]["ttft_speedup_vs_hf"] = round(hf["ttft_ms"] / summary[name]["ttft_ms"], 2)
        summary[name]["greedy_tokens_equal_hf"] = runs[name][0]["tokens"] == runs["hf_eager"][0]["tokens"]
    summary["setup"] = {k: v for k, v in vars(args).items() if k != "workdir"}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
