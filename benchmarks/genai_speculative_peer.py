"""The peer side of issue 54: onnxruntime-genai's own draft-model speculative decoding on the CPU.

onnxruntime-genai (0.18.0 here) runs draft-model speculation when its genai_config.json carries a
`model.draft` decoder block beside `model.decoder` (docs/SpeculativeDecoding.md in its repository);
`GeneratorParams.set_speculative_options(max_draft_tokens=K, min_adaptive_k=...)` picks the width per
generator, and the generation loop is the plain one (`append_tokens`, `generate_next_token` until
`is_done`), one token out per call. Batch 1 and greedy or sampled search only.

This script builds (or reuses, from the cache `kvforge bench --compare ort-genai` uses) the peer's fp32
and int4 models of one Hugging Face folder with its model builder, writes a composite folder whose
target is the fp32 model and whose draft is the int4 one, and times, at batch 1, greedy, the same
chat prompts (questions whose answers do not repeat the prompt) with N new tokens:

- `ort-genai fp32`: plain decoding of the fp32 model (issue 54's baseline),
- `ort-genai int4`: plain decoding of the draft alone (what one draft step costs),
- `ort-genai spec k=K`: fp32 target, int4 draft, fixed width K, for each `--k`,
- `ort-genai spec adaptive`: the same with its adaptive width (`min_adaptive_k=2`), unless `--no-adaptive`.

The systems take turns prompt by prompt, round by round, in one process (the speculative model holds
its own fp32 target session, so the fp32 weights are loaded twice). Decode tokens/s excludes the
prefill (append + first token), as kvforge's bench does; each speculative run is paired with the plain
fp32 run of the same prompt and round, and the report gives the median of those paired ratios, the
acceptance rate, and whether speculation gave plain greedy decoding's tokens. `repeat_4gram_share`:
the share of generated 4-grams already seen earlier in prompt or output (speculation gains on repeats).

    OMP_NUM_THREADS=2 PYTHONPATH=/tmp/ogpath:. python benchmarks/genai_speculative_peer.py \\
        --source /tmp/spec/smol.hf --threads 2 --new-tokens 128 --repeat 3 --json out.json

Needs onnxruntime-genai importable (`pip install -e '.[bench]'`, or a PYTHONPATH folder holding only
its package) and, to build the peer's models, torch/transformers/onnx_ir (kvforge's export extras).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvforge.tools.bench import CACHE, _genai_model  # noqa: E402  (the peer's cached builder outputs)

QUESTIONS = (
    "Explain how a rainbow forms.",
    "What are three tips for staying focused while studying?",
    "Why do cats purr?",
    "Write a short story about a robot who learns to paint.",
)
BASELINE = "ort-genai fp32"


def speculative_folder(target: Path, draft: Path, width: int = 4) -> Path:
    """A genai folder whose `model.decoder` is `target`'s and whose `model.draft` is `draft`'s decoder.

    The release rejects ".." in config paths ("Config path must not contain path traversal (..)"),
    although its docs show "../target/model.onnx": the two models are linked in as subfolders instead.
    """
    out = CACHE / f"genai-spec-{target.name}--{draft.name}"
    out.mkdir(parents=True, exist_ok=True)
    for name, folder in (("target", target), ("draft", draft)):
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(folder.resolve(), target_is_directory=True)
    config = json.loads((target / "genai_config.json").read_text())
    draft_decoder = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["decoder"]["filename"] = "target/" + config["model"]["decoder"]["filename"]
    draft_decoder["filename"] = "draft/" + draft_decoder["filename"]
    config["model"]["draft"] = draft_decoder
    config["speculative"] = {"max_draft_tokens": width}
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    return out


def load(folder: Path, threads: int) -> Any:
    """The peer's model as it is meant to run: its config with the thread count overlaid (the draft too)."""
    import onnxruntime_genai as og

    options = {"session_options": {"intra_op_num_threads": threads}}
    has_draft = "draft" in json.loads((folder / "genai_config.json").read_text())["model"]
    overlay = {"model": {"decoder": options, **({"draft": options} if has_draft else {})}}
    config = og.Config(str(folder))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


def chat_ids(model: Any, question: str) -> list[int]:
    """The question in the model's chat template, with the assistant turn opened."""
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(model)
    messages = json.dumps([{"role": "user", "content": question}])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text)]


def generate(model: Any, ids: list[int], new_tokens: int, speculative: dict[str, Any] | None) -> dict[str, Any]:
    """Exactly `new_tokens` greedy tokens (min_length = max_length); time to first token, decode tokens/s."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens, do_sample=False)
    if speculative is not None:
        params.set_speculative_options(**speculative)
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()
    first = time.perf_counter()
    count = 1
    while not generator.is_done():
        generator.generate_next_token()
        count += 1
    end = time.perf_counter()
    out = [int(t) for t in generator.get_sequence(0)[len(ids):]]
    row: dict[str, Any] = {"ttft_ms": 1e3 * (first - start), "decode_tokens_per_s": (count - 1) / (end - first),
                           "e2e_tokens_per_s": count / (end - start), "tokens": out}
    if speculative is not None:
        stats = generator.get_speculative_stats()
        row["acceptance_rate"] = float(stats["acceptance_rate"])
        row["tokens_per_target_pass"] = count / max(1.0, float(stats["target_forward_passes"]))
    return row


def repeat_share(prompt: list[int], out: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that already occurred earlier in prompt + output."""
    seq, seen, hits = prompt + out, set(), 0
    for i in range(len(seq) - n + 1):
        gram = tuple(seq[i:i + n])
        if i >= len(prompt):
            hits += gram in seen
        seen.add(gram)
    return hits / max(1, len(out) - n + 1)


def systems(widths: list[int], adaptive: bool) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """name -> (which model, speculative options or None for plain decoding)."""
    table: dict[str, tuple[str, dict[str, Any] | None]] = {BASELINE: ("fp32", None), "ort-genai int4": ("int4", None)}
    for k in widths:
        table[f"ort-genai spec k={k}"] = ("spec", {"max_draft_tokens": k, "min_adaptive_k": 0})
    if adaptive:
        table["ort-genai spec adaptive"] = ("spec", {"min_adaptive_k": 2, "max_draft_tokens": 4})
    return table


def run_rounds(models: dict[str, Any], table: dict[str, tuple[str, dict[str, Any] | None]],
               prompts: list[list[int]], new_tokens: int, repeat: int) -> dict[str, list[list[dict[str, Any]]]]:
    """rows[system][prompt] = one result per round; the systems' order rotates every prompt and round."""
    names = list(table)
    for name in names:  # warm-up: sessions, allocator, thread pools
        generate(models[table[name][0]], prompts[0], 16, table[name][1])
    rows: dict[str, list[list[dict[str, Any]]]] = {name: [[] for _ in prompts] for name in names}
    turn = 0
    for _ in range(repeat):
        for p, ids in enumerate(prompts):
            order = names[turn % len(names):] + names[:turn % len(names)]
            turn += 1
            for name in order:
                which, options = table[name]
                rows[name][p].append(generate(models[which], ids, new_tokens, options))
    return rows


def summarise(rows: dict[str, list[list[dict[str, Any]]]], prompts: list[list[int]]) -> dict[str, Any]:
    """Medians per system, paired ratios to the fp32 baseline, token equality with it."""
    base = rows[BASELINE]
    report: dict[str, Any] = {}
    for name, per_prompt in rows.items():
        flat = [r for runs in per_prompt for r in runs]
        entry: dict[str, Any] = {
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in flat),
            "e2e_tokens_per_s": statistics.median(r["e2e_tokens_per_s"] for r in flat),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in flat),
            "decode_tokens_per_s_range": [min(r["decode_tokens_per_s"] for r in flat),
                                          max(r["decode_tokens_per_s"] for r in flat)],
            "per_prompt_decode_tokens_per_s": [statistics.median(r["decode_tokens_per_s"] for r in runs)
                                               for runs in per_prompt],
        }
        if name != BASELINE:
            entry["decode_over_fp32"] = statistics.median(
                r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for runs, bases in zip(per_prompt, base, strict=True) for r, b in zip(runs, bases, strict=True))
            entry["same_tokens_as_fp32"] = all(r["tokens"] == bases[0]["tokens"]
                                               for runs, bases in zip(per_prompt, base, strict=True) for r in runs)
        if "acceptance_rate" in flat[0]:
            entry["acceptance_rate"] = statistics.median(r["acceptance_rate"] for r in flat)
            entry["tokens_per_target_pass"] = statistics.median(r["tokens_per_target_pass"] for r in flat)
        report[name] = entry
    report[BASELINE]["repeat_4gram_share"] = [repeat_share(ids, runs[0]["tokens"])
                                              for ids, runs in zip(prompts, base, strict=True)]
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the Hugging Face folder both systems start from")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="fixed draft widths to time")
    parser.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-width row")
    parser.add_argument("--prompt-ids", help="JSON list of prompt id lists (the kvforge side's), instead of QUESTIONS")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)

    import onnxruntime
    import onnxruntime_genai as og

    load_before = os.getloadavg()
    source = Path(args.source)
    folders = {p: _genai_model(source, p, print) for p in ("fp32", "int4")}
    folders["spec"] = speculative_folder(folders["fp32"], folders["int4"])
    models = {name: load(folder, args.threads) for name, folder in folders.items()}
    if args.prompt_ids:
        prompts = [list(map(int, p)) for p in json.loads(Path(args.prompt_ids).read_text())]
    else:
        prompts = [chat_ids(models["fp32"], q) for q in QUESTIONS]
    table = systems(args.k, not args.no_adaptive)
    started = time.perf_counter()
    rows = run_rounds(models, table, prompts, args.new_tokens, args.repeat)
    report = {
        "onnxruntime_genai": og.__version__, "onnxruntime": onnxruntime.__version__,
        "source": str(source), "models": {k: str(v) for k, v in folders.items()},
        "threads": args.threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "new_tokens": args.new_tokens, "repeat": args.repeat, "batch": 1, "search": "greedy",
        "prompt_ids": prompts, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "seconds": time.perf_counter() - started, "systems": summarise(rows, prompts),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
