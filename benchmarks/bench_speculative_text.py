"""Prompt-lookup speculation on real text: the real SmolLM2-135M-Instruct summarises and edits a
303-word passage (benchmarks/data/passage.txt), kvforge plain greedy vs kvforge with
`speculate="prompt-lookup"` vs onnxruntime-genai's plain greedy decoding on the same prompt ids.

The three take turns task by task, round by round, in one process (2 threads each); the table
reports medians of end-to-end tokens/s (request start to last token, prefill included), decode
tokens/s (prefill excluded) and the acceptance rate, and checks that speculation gives plain
decoding's tokens.

    python benchmarks/bench_speculative_text.py --export kvforge-demo/smollm2-135m-instruct-ort \\
        --genai-source kvforge-demo/smollm2-135m-instruct.hf --repeat 3 --json out.json

--genai-source: the Hugging Face folder onnxruntime-genai's model builder converts (fp32, cached as
`kvforge bench --compare ort-genai` caches it); leave it out to skip that peer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

PASSAGE = (Path(__file__).parent / "data" / "passage.txt").read_text().strip()
# Misspellings for the correction task (each word as it appears in the passage -> the error).
TYPOS = {"history": "histroy", "families": "familys", "pastures": "pastyres", "gathered": "gatherd",
         "visitors": "visiters", "repaired": "repiared", "furniture": "furnature", "weather": "wether",
         "quieter": "quietter", "returned": "returnd", "morning": "mornig", "village": "vilage"}
TASKS = {
    "summarise": f"Summarise the following passage in three sentences.\n\n{PASSAGE}",
    "correct spelling": "Rewrite this passage correcting the spelling mistakes, and change nothing else.\n\n"
    + re.sub("|".join(rf"\b{w}\b" for w in TYPOS), lambda m: TYPOS[m.group(0)], PASSAGE),
    "past tense": f"Rewrite this passage in the past tense, keeping every sentence.\n\n{PASSAGE}",
}


class GenaiPeer:
    """onnxruntime-genai's plain greedy decoding of given prompt ids, to its EOS or max_new_tokens."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def generate(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        start = time.perf_counter()
        generator = og.Generator(self.model, params)
        generator.append_tokens(prompt)
        generator.generate_next_token()
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        end = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt):]]
        return {"tokens": tokens, "end_to_end_tokens_per_s": len(tokens) / (end - start),
                "decode_tokens_per_s": (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True, help="a kvforge export of SmolLM2-135M-Instruct")
    parser.add_argument("--genai-source", type=Path, help="its Hugging Face folder, for onnxruntime-genai")
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from kvforge.runtime import Generator

    generator = Generator(args.export, threads=args.threads)
    modes = ["kvforge plain", "kvforge lookup"]
    peer = None
    if args.genai_source is not None:
        from kvforge.tools import bench

        peer = GenaiPeer(bench._genai_model(args.genai_source, "fp32", print), args.threads)
        modes.append("ort-genai plain")

    def run(mode: str, prompt: list[int]) -> dict[str, Any]:
        if mode == "ort-genai plain":
            assert peer is not None
            return peer.generate(prompt, args.new_tokens)
        extra = {"speculate": "prompt-lookup", "draft_len": args.draft_len} if mode == "kvforge lookup" else {}
        start = time.perf_counter()
        result = generator.generate([prompt], max_new_tokens=args.new_tokens, greedy=True, **extra)
        total = time.perf_counter() - start
        return {"tokens": result.tokens[0], "end_to_end_tokens_per_s": len(result.tokens[0]) / total,
                "decode_tokens_per_s": result.decode_tokens_per_s, "graph_runs": result.steps + 1,
                "drafted": result.draft_tokens, "accepted": result.accepted_tokens}

    prompts = {task: generator.chat_ids(text) for task, text in TASKS.items()}
    for mode in modes:  # warm-up
        run(mode, prompts["summarise"][:64])

    rows = []
    for task, prompt in prompts.items():
        samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(args.repeat):
            for mode in modes:  # take turns, so that machine noise hits all alike
                samples[mode].append(run(mode, prompt))
        plain, lookup = samples["kvforge plain"][-1], samples["kvforge lookup"][-1]
        row: dict[str, Any] = {"task": task, "prompt_tokens": len(prompt), "new_tokens": len(plain["tokens"]),
                               "identical_tokens": all(s["tokens"] == plain["tokens"] for s in samples["kvforge lookup"]),
                               "drafted": lookup["drafted"], "accepted": lookup["accepted"],
                               "acceptance_rate": round(lookup["accepted"] / lookup["drafted"], 3) if lookup["drafted"] else 0.0,
                               "graph_runs": [plain["graph_runs"], lookup["graph_runs"]],
                               "answer_start": generator.tokenizer.decode(plain["tokens"])[:160]}
        for mode, runs in samples.items():
            for metric in ("end_to_end_tokens_per_s", "decode_tokens_per_s"):
                values = [s[metric] for s in runs]
                row[f"{mode}: {metric}"] = round(statistics.median(values), 1)
                row[f"{mode}: {metric} spread"] = [round(min(values), 1), round(max(values), 1)]
        base = row["kvforge plain: end_to_end_tokens_per_s"]
        row["lookup_over_plain_end_to_end"] = round(row["kvforge lookup: end_to_end_tokens_per_s"] / base, 2)
        if peer is not None:
            genai = samples["ort-genai plain"][-1]
            row["genai_tokens"] = len(genai["tokens"])
            row["genai_same_tokens_as_kvforge"] = genai["tokens"] == plain["tokens"]
            row["lookup_over_genai_end_to_end"] = round(
                row["kvforge lookup: end_to_end_tokens_per_s"] / row["ort-genai plain: end_to_end_tokens_per_s"], 2)
            row["plain_over_genai_end_to_end"] = round(base / row["ort-genai plain: end_to_end_tokens_per_s"], 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "answer_start"}))
    print(f"\n| task | new tokens | same tokens | acceptance | graph runs plain -> lookup | end-to-end tok/s: "
          f"{' / '.join(modes)} | lookup / plain |" + (" lookup / ort-genai |" if peer else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if peer else ""))
    for row in rows:
        speeds = " / ".join(f"{row[f'{mode}: end_to_end_tokens_per_s']:.1f}" for mode in modes)
        print(f"| {row['task']} | {row['new_tokens']} | {'yes' if row['identical_tokens'] else 'NO'} | "
              f"{row['acceptance_rate']:.0%} ({row['accepted']}/{row['drafted']}) | {row['graph_runs'][0]} -> "
              f"{row['graph_runs'][1]} | {speeds} | x{row['lookup_over_plain_end_to_end']:.2f} |"
              + (f" x{row['lookup_over_genai_end_to_end']:.2f} |" if peer else ""))
    if args.json:
        args.json.write_text(json.dumps({"export": str(args.export), "draft_len": args.draft_len, "repeat": args.repeat,
                                         "threads": args.threads, "new_tokens": args.new_tokens, "tasks": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
