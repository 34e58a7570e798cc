"""Greedy exactness of speculation on every tiny text recipe: each recipe's fp32 `ort` export, drafted for by its
fp16 export (a draft model) and by prompt lookup, must give plain greedy decoding's tokens, on a prompt that
repeats itself (so prompt lookup drafts too) and one that does not.

    python benchmarks/speculation_recipes.py --work /tmp/spec-recipes --json benchmarks/results/speculation_recipes.json

Slow (two exports per recipe, minutes on 2 cores); the suite runs the same checks on llama-tiny
(tests/test_draft_model.py, tests/test_speculative.py) and the real SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = [[1, 50, 60, 70, 80, 50, 60, 70, 80, 50, 60], [1, 17, 230, 41, 9, 77, 12, 300, 5]]


def check(recipe: str, work: Path) -> dict:
    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import materialize
    from kvforge.runtime import Generator

    hf, target, draft = work / f"{recipe}.hf", work / f"{recipe}-fp32", work / f"{recipe}-fp16"
    if not (hf / "config.json").is_file():
        materialize(recipe, hf, force=True)
    for folder, dtype in ((target, "fp32"), (draft, "fp16")):
        if not (folder / "kvforge.json").is_file():
            export_model(hf, folder, dtype=dtype, force=True)
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
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kvforge.models.recipes import FAMILY_RECIPES

    recipes = [r for r in args.recipes.split(",") if r] or list(FAMILY_RECIPES)
    report: dict = {}
    for recipe in recipes:
        started = time.perf_counter()
        try:
            report[recipe] = check(recipe, args.work)
        except Exception as err:  # noqa: BLE001 (a recipe that fails is reported, the sweep goes on)
            report[recipe] = {"error": f"{type(err).__name__}: {err}"}
        report[recipe]["seconds"] = round(time.perf_counter() - started, 1)
        print(recipe, json.dumps(report[recipe]), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
