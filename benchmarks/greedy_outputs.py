"""Greedy outputs of every tiny recipe and the real SmolLM2, through the Generator and the serving
Scheduler, to a JSON file; or the comparison of two such files. A refactor that must change no
behaviour records them before and after:

    python benchmarks/greedy_outputs.py record before.json [--work DIR]   # with the old code importable
    python benchmarks/greedy_outputs.py record after.json  [--work DIR]
    python benchmarks/greedy_outputs.py compare before.json after.json    # exit 1 on any difference

Per export: a batch of three prompts of different lengths (Generator), each prompt alone, the same
prompts served together by a 4-row Scheduler (chunked prefill, rows moving), prompt-lookup speculation,
and a sampled request with a seed (temperature, top-k, top-p: the sampler's draws must not move either).
The exports are made once in --work and reused (the graphs do not depend on the runtime's code).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROMPTS = [[1, 50, 60, 70, 80, 90, 100, 7], [1, 33, 44], [1, 5, 9, 200, 300, 11, 12, 13, 14, 15, 16, 17, 18]]
TEXTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.", "def main(): return 42"]


def _exports(work: Path) -> dict[str, Path]:
    from kvforge.cli.demo import REAL_NAME, installed_real_model
    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import FAMILY_RECIPES, materialize

    out = {}
    for recipe in FAMILY_RECIPES:
        folder = work / f"{recipe}-ort"
        if not (folder / "kvforge.json").is_file():
            hf = work / "hf" / recipe
            if not (hf / "config.json").is_file():
                materialize(recipe, hf, force=True)
            export_model(hf, folder, target="ort", force=True)
        out[recipe] = folder
    gguf = installed_real_model()
    if gguf is not None:
        folder = work / f"{REAL_NAME}-ort"
        if not (folder / "kvforge.json").is_file():
            export_model(gguf, folder, target="ort", hf_dir=work / f"{REAL_NAME}.hf", force=True)
        out[REAL_NAME] = folder
        # The real model in fp16 and int4 too: the exports whose weights are cast or quantised on the way.
        for name, options in (("fp16", {"dtype": "fp16"}), ("int4", {"quantize": "int4", "quant_method": "rtn"})):
            folder = work / f"{REAL_NAME}-ort-{name}"
            if not (folder / "kvforge.json").is_file():
                export_model(work / f"{REAL_NAME}.hf", folder, target="ort", force=True, **options)
            out[f"{REAL_NAME}-{name}"] = folder
    return out


def _outputs(folder: Path) -> dict[str, Any]:
    from kvforge.runtime import GenerationRequest, Generator, SamplingConfig

    try:  # code from before runtime/ was grouped by role (the "before" of a comparison)
        from kvforge.runtime.scheduler import Scheduler
    except ImportError:
        from kvforge.runtime.drivers.scheduler import Scheduler

    gen = Generator(folder)
    vocab = gen.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    record: dict[str, Any] = {}
    record["batch"] = gen.generate(prompts, max_new_tokens=24, greedy=True, ignore_eos=True).tokens
    record["solo"] = [gen.generate([p], max_new_tokens=24, greedy=True, ignore_eos=True).tokens[0] for p in prompts]
    lookup = [[(t % 40) + 3 for t in range(30)]]
    record["speculate"] = gen.generate(lookup, max_new_tokens=24, greedy=True, ignore_eos=True,
                                       speculate="prompt-lookup").tokens
    record["sampled"] = gen.generate(prompts, max_new_tokens=16, temperature=0.8, top_k=40, top_p=0.9, seed=7,
                                     ignore_eos=True).tokens
    if gen.tokenizer is not None:
        record["text"] = gen.generate(TEXTS, max_new_tokens=16, greedy=True).text
    # Submitted before the scheduler starts, so that its steps do not depend on thread timing (a model whose
    # numerics depend on the batch, as LongRoPE's choice of factors by the longest row, would answer otherwise).
    scheduler = Scheduler(gen, max_batch=4, max_seq_len=128, prefill_chunk=4)
    try:
        handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True))
                   for p, n in zip(prompts * 2, [5, 20, 9, 14, 3, 11], strict=True)]
        scheduler.start()
        record["served"] = [h.result()[0] for h in handles]
    finally:
        scheduler.close()
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--work", type=Path, default=Path("/tmp/kvforge-greedy-outputs"))
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        import kvforge

        results = {"kvforge": str(Path(kvforge.__file__).parent)}
        for name, folder in _exports(args.work).items():
            results[name] = _outputs(folder)
            print(f"{name}: recorded", file=sys.stderr)
        args.out.write_text(json.dumps(results, indent=1))
        return 0
    before, after = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    names = sorted(set(before) | set(after) - {"kvforge"})
    differ = [f"{n}.{k}" for n in names if n != "kvforge" for k in sorted(set(before.get(n, {})) | set(after.get(n, {})))
              if before.get(n, {}).get(k) != after.get(n, {}).get(k)]
    checked = sum(len(before.get(n, {})) for n in names if n != "kvforge")
    print(f"{checked} outputs of {len(names) - ('kvforge' in names)} exports compared; "
          f"{'identical' if not differ else 'DIFFERENT: ' + ', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
