"""What an int8 KV cache (`kvforge export --kv-cache int8`) costs in accuracy against the fp32 cache.

Both exports of the same model score kvforge's shipped text (kvforge/data/perplexity.txt, ~3000
tokens; `--max-tokens 1024`: its first 1024, which the export's calibration does not see) in windows
of each given length (0: all of it as one window; `--repeat-text N` repeats the text N times first): perplexity of each, and teacher-forced greedy
agreement (the share of positions where both exports' most likely next token is the same), from one
prefill per window (Generator.prompt_logprobs, top 1). Then free-running greedy decoding of the
parity prompts: how many leading tokens are identical.

    python benchmarks/kv_cache_accuracy.py FP32_EXPORT INT8_EXPORT [--windows 256,0] [--repeat-text 1]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kvforge.runtime import GenerationRequest, Generator
from kvforge.tools.parity import DEFAULT_PROMPTS, PERPLEXITY_TEXT


def window_scores(gen: Generator, window: list[int]) -> tuple[np.ndarray, list[int]]:
    """Log-probabilities of window[1:] and the most likely token at each position."""
    scored = gen.prompt_logprobs(window, top=1)[1:]
    return np.array([s.logprob for s in scored]), [s.top[0][0] for s in scored]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fp32")
    parser.add_argument("int8")
    parser.add_argument("--windows", default="256,0")
    parser.add_argument("--repeat-text", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="score the first N tokens only (1024: the ones --kv-cache calibration skips)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    gens = {"fp32": Generator(args.fp32, threads=args.threads), "int8": Generator(args.int8, threads=args.threads)}
    ids = gens["fp32"].tokenizer.encode(PERPLEXITY_TEXT.read_text() * args.repeat_text)[: args.max_tokens or None]
    report: dict = {"text_tokens": len(ids), "perplexity": {}, "generation": []}
    for size in (int(w) for w in args.windows.split(",")):
        size = size or len(ids)
        windows = [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]
        logp: dict[str, list[np.ndarray]] = {name: [] for name in gens}
        top: dict[str, list[int]] = {name: [] for name in gens}
        for window in windows:
            for name, gen in gens.items():
                lp, best = window_scores(gen, window)
                logp[name].append(lp)
                top[name] += best
        ppl = {name: float(np.exp(-np.concatenate(v).mean())) for name, v in logp.items()}
        agree = sum(a == b for a, b in zip(top["fp32"], top["int8"], strict=True))
        report["perplexity"][str(size)] = {**ppl, "relative_increase": ppl["int8"] / ppl["fp32"] - 1,
                                           "teacher_forced_agreement": f"{agree}/{len(top['fp32'])}",
                                           "windows": len(windows)}
        print(f"windows of {size} tokens ({len(windows)}): perplexity fp32 {ppl['fp32']:.4f}, int8 {ppl['int8']:.4f} "
              f"({100 * (ppl['int8'] / ppl['fp32'] - 1):+.2f}%); same top-1 token at {agree}/{len(top['fp32'])} positions",
              flush=True)
    for prompt in DEFAULT_PROMPTS:
        request = GenerationRequest(prompt, args.new_tokens, ignore_eos=True)
        tokens = {name: gen.generate(request).tokens[0] for name, gen in gens.items()}
        same = next((i for i, (a, b) in enumerate(zip(tokens["fp32"], tokens["int8"], strict=True)) if a != b),
                    args.new_tokens)
        report["generation"].append({"prompt": prompt, "identical_leading_tokens": same, "of": args.new_tokens})
        print(f"greedy {prompt[:30]!r}: first {same}/{args.new_tokens} tokens identical", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
