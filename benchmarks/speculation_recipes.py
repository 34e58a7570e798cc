"""Greedy exactness of speculation on every tiny text recipe: each recipe's fp32 export (`--target ort` or
`onnx`), drafted for by its int4 export on `ort` (a draft that is sometimes wrong, so rejections and rollback run;
its fp16 export on `onnx`, which takes no int4) and
by prompt lookup, must give plain greedy decoding's tokens, on a prompt that repeats itself (so prompt lookup
drafts too) and one that does not, at draft lengths 2 and 5.

    python benchmarks/speculation_recipes.py --target ort --json benchmarks/results/speculation_recipes_ort.json
    python benchmarks/speculation_recipes.py --target onnx --json benchmarks/results/speculation_recipes_onnx.json

Two exports per recipe, about 30 s a recipe on one thread; the suite runs the same checks on llama-tiny
(tests/runtime/test_draft_model.py, tests/runtime/test_speculative.py) and the real SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = [[1, 50, 60, 70, 80, 50, 60, 70, 80, 50, 60], [1, 17, 230, 41, 9, 77, 12, 300, 5]]


def check(recipe: str, work: Path, target_name: str = "ort") -> dict:
    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import materialize
    from kvforge.runtime import Generator

    hf = work / f"{recipe}.hf"
    # `onnx` takes no int4 (MatMulNBits is ONNX Runtime's): its draft is the fp16 export
    quantize, dtype = ("int4", "fp32") if target_name == "ort" else (None, "fp16")
    target, draft = work / f"{recipe}-{target_name}-fp32", work / f"{recipe}-{target_name}-{quantize or dtype}"
    if not (hf / "config.json").is_file():
        materialize(recipe, hf, force=True)
    for folder, options in ((target, {}), (draft, {"quantize": quantize, "dtype": dtype})):
        if not (folder / "kvforge.json").is_file():
            export_model(hf, folder, target=target_name, force=True, **options)
    generator = Generator(target, draft=draft)
    row: dict = {}
    for method in ("draft", "prompt-lookup"):
        same, drafted, accepted = True, 0, 0
        for prompt in PROMPTS:
            plain = generator.generate([prompt], max_new_tokens=20, greedy=True, ignore_eos=True)
            for k in (2, 5):
                spec = generator.generate([prompt], max_new_tokens=20, greedy=True, ignore_eos=True, speculate=method,
                                          draft_len=k)
                same &= spec.tokens == plain.tokens
                drafted, accepted = drafted + spec.draft_tokens, accepted + spec.accepted_tokens
        row[method] = {"same_tokens": same, "accepted": f"{accepted}/{drafted}"}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/spec-recipes"))
    parser.add_argument("--recipes", default="", help="comma-separated (default: every tiny text recipe)")
    parser.add_argument("--target", default="ort", choices=("ort", "onnx"), help="the exports' target")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kvforge.models.recipes import FAMILY_RECIPES

    recipes = [r for r in args.recipes.split(",") if r] or list(FAMILY_RECIPES)
    report: dict = {}
    for recipe in recipes:
        started = time.perf_counter()
        try:
            report[recipe] = check(recipe, args.work, args.target)
        except Exception as err:  # noqa: BLE001 (a recipe that fails is reported, the sweep goes on)
            report[recipe] = {"error": f"{type(err).__name__}: {err}"}
        report[recipe]["seconds"] = round(time.perf_counter() - started, 1)
        print(recipe, json.dumps(report[recipe]), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
