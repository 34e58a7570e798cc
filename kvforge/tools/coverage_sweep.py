"""The architecture coverage sweep's runner: exports every causal-LM model type of the installed
transformers on every target and checks it against Hugging Face eager (the types, their tiny configs,
the reasons: kvforge/tools/coverage_fixtures.py; the table: coverage_table.py).

    python -m kvforge.tools.coverage_sweep --write [TYPE ...] [--targets ort,onnx,trt] [--part K/N]

It drives the exporter, the runtime and the parity check, so it sits with the apps, above them.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from kvforge.tools.coverage_fixtures import (
    ATOL,
    COVERAGE_FILE,
    KERNEL_SHAPES,
    MISSING_FEATURES,
    MULTIMODAL_TYPES,
    NEW_TOKENS,
    NOT_SWEPT,
    OUT_OF_SCOPE,
    PROMPTS,
    REQUIRED_TARGETS,
    SWEEP_TARGETS,
    build_tiny,
    causal_lm_types,
    real_summary,
)


def check_target(model_type: str, hf_dir: Path, out: Path, target: str, hf_model: Any,
                 families: Any = None) -> dict[str, Any]:
    """Export on `target` and check it: parity against HF eager (fp32, greedy, atol 1e-3) and the
    prompts as one batch against each alone."""
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator
    from kvforge.tools.parity import run_parity

    started = time.perf_counter()
    # A multimodal checkpoint's text model is what the sweep checks (the tiny folder has no image processor).
    export_model(hf_dir, out, target=target, force=True, families=families, text_only=model_type in MULTIMODAL_TYPES)
    options = {"emulation": "reference"} if target == "trt" else {}  # the numpy kernel: the Triton one is slow here
    report = run_parity(hf_dir, out, list(PROMPTS), NEW_TOKENS, ATOL, backend_options=options,
                        perplexity_tokens=0, hf_model=hf_model)
    generator = Generator(out, **options)
    ids = [generator.tokenizer.encode(text) for text in PROMPTS]
    batch = generator.generate(ids, max_new_tokens=16, greedy=True, ignore_eos=True)
    alone = [generator.generate([row], max_new_tokens=16, greedy=True, ignore_eos=True).tokens[0] for row in ids]
    result = {"status": "pass" if report.passed and batch.tokens == alone else "fail",
              "max_abs_err": float(report.max_abs_err), "seconds": round(time.perf_counter() - started, 1)}
    if not report.passed:
        result["error"] = report.failure_reason()
    elif batch.tokens != alone:
        result["error"] = "a batch of prompts of different lengths gives other tokens than each prompt alone"
    return result


def sweep_one(model_type: str, targets: tuple[str, ...] = SWEEP_TARGETS, real: bool = False) -> dict[str, Any]:
    """One model type's row of the coverage table (`real`: at its default config's layer shapes)."""
    from kvforge.core.errors import UnsupportedModelError
    from kvforge.models.families import HAND_WRITTEN, logit_keys, trial_registry

    if model_type in OUT_OF_SCOPE:
        return {"status": "out of scope", "reason": OUT_OF_SCOPE[model_type]}
    if model_type in NOT_SWEPT:
        return {"status": "refused", "reason": NOT_SWEPT[model_type], "targets": {}}
    hand_written = model_type in HAND_WRITTEN
    row: dict[str, Any] = {"hand_written": hand_written, "targets": {}}
    with tempfile.TemporaryDirectory(prefix=f"kvforge-coverage-{model_type}-") as tmp:
        hf_dir = Path(tmp) / "hf"
        try:
            model = build_tiny(model_type, hf_dir, real=real)
        except Exception as err:  # transformers' own failure to build the type at these sizes
            reason = f"not swept: transformers cannot build its tiny config ({type(_root(err)).__name__})"
            return {**row, "status": "refused", "reason": MISSING_FEATURES.get(model_type, reason),
                    "error": f"building: {_one_line(err)}"}
        row["architecture"] = type(model).__name__
        reference = model  # the parity reference: a multimodal checkpoint's is its text model, as the export's
        if model_type in MULTIMODAL_TYPES:
            try:
                reference = _text_reference(model, hf_dir, row)
            except Exception as err:  # the checkpoint's text model could not be loaded, or computes otherwise
                return {**row, "status": "refused", "reason": f"its text model: {_one_line(err)}"[:400]}
        row["logit_keys"] = logit_keys(reference.config)
        registry = trial_registry(model_type, type(model).__name__, reference.config)
        for target in targets:
            try:
                row["targets"][target] = check_target(model_type, hf_dir, Path(tmp) / target, target, reference,
                                                      registry)
            except Exception as err:  # any failure of export or parity is this type's result
                row["targets"][target] = {"status": "fail", "error": _one_line(err),
                                          "where": _where(err)}
                if KERNEL_SHAPES in str(_root(err)):
                    # The tiny config's head size, not the type: `--target trt` checks it per model.
                    row["targets"][target]["status"] = "untested"
                elif isinstance(_root(err), UnsupportedModelError):  # kvforge named what is missing
                    row.setdefault("refusal", str(_root(err)).removeprefix(f"{model_type}: "))
            shutil.rmtree(Path(tmp) / target, ignore_errors=True)
    required = [target for target in REQUIRED_TARGETS if target in targets] or list(REQUIRED_TARGETS)
    passed = all(row["targets"].get(target, {}).get("status") == "pass" for target in required)
    row["status"] = "pass" if passed else "refused"
    if not passed:
        row["reason"] = MISSING_FEATURES.get(model_type) or row.pop("refusal", None) or _undiagnosed(row)
    elif row["targets"].get("trt", {}).get("status") == "fail":
        row["trt_reason"] = row.pop("refusal", None) or row["targets"]["trt"].get("error", "")[:200]
    row.pop("refusal", None)
    return row


RTX_SEQ_LEN = 64  # the engines' capacity in --rtx builds: the tiny export's, small and quick


def rtx_one(model_type: str) -> dict[str, Any]:
    """TensorRT for RTX's engines of the type's tiny `onnx` export, built (on this CPU: its builder needs no GPU):
    {"status": "built", "seconds", "attention": per engine} or "refused" (kvforge's one-line reason) or "fail"
    (the builder's error). Built engines are not run here: running them needs an RTX GPU."""
    from kvforge.core.errors import KvforgeError
    from kvforge.engines.trt_build import build_engines
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry

    with tempfile.TemporaryDirectory(prefix=f"kvforge-rtx-{model_type}-") as tmp:
        hf_dir, out = Path(tmp) / "hf", Path(tmp) / "onnx"
        try:
            model = build_tiny(model_type, hf_dir)
            reference = _text_reference(model, hf_dir, {}) if model_type in MULTIMODAL_TYPES else model
            export_model(hf_dir, out, target="onnx", families=trial_registry(model_type, type(model).__name__,
                                                                             reference.config),
                         text_only=model_type in MULTIMODAL_TYPES)
        except Exception as err:  # noqa: BLE001 - no export to build from: the sweep's row says why
            return {"status": "unexported", "error": _one_line(err)[:200]}
        started = time.perf_counter()
        try:
            record = build_engines(out, max_batch=2, max_seq_len=RTX_SEQ_LEN, tensorrt="tensorrt-rtx")
        except KvforgeError as err:
            return {"status": "refused", "error": " ".join(str(err).replace(str(out), "the export").split())[:200]}
        except Exception as err:  # noqa: BLE001 - the builder's own failure is this type's result
            return {"status": "fail", "error": _one_line(err)[:200]}
        return {"status": "built", "seconds": round(time.perf_counter() - started, 1),
                "attention": sorted({built["attention"] for built in record["builds"].values()})}


def _text_reference(model: Any, hf_dir: Path, row: dict[str, Any]) -> Any:
    """A multimodal checkpoint's text model, loaded as the export loads it (row["text_model"] names it), after
    checking it against the whole checkpoint's tokens-only forward (where transformers runs one)."""
    import torch

    from kvforge.exporter.text_model import load_text_model

    text = load_text_model(hf_dir, "fp32")
    row["text_model"] = {"model_type": text.config.model_type, "architecture": type(text).__name__}
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 200, 17]])
    with torch.no_grad():
        try:
            whole = model(input_ids=ids).logits
        except Exception as err:  # noqa: BLE001 - transformers' own tokens-only path fails (Llama 4's)
            row["text_model"]["checkpoint_forward"] = _one_line(err)[:200]
            return text
        error = float((text(ids).logits - whole).abs().max())
    row["text_model"]["checkpoint_max_abs_err"] = error
    if not error <= ATOL:
        raise ValueError(f"the text model's logits differ from the checkpoint's tokens-only forward by {error:.3g}")
    return text


def _undiagnosed(row: dict[str, Any]) -> str:
    """The reason for a type kvforge exports but gets wrong: its parity failure, until it is named."""
    errors = [result["max_abs_err"] for result in row["targets"].values() if result.get("max_abs_err") is not None]
    if errors:
        return f"parity fails (max logit error {max(errors):.2g} > {ATOL}); the cause is not yet diagnosed"
    first = next((result.get("error", "") for result in row["targets"].values()), "")
    return f"export fails, not yet diagnosed: {first[:160]}"


def _root(err: BaseException) -> BaseException:
    """kvforge's own refusal where there is one (it names the missing feature), else the innermost
    cause: torch.onnx wraps the real error in pages of advice."""
    from kvforge.core.errors import UnsupportedModelError

    while not isinstance(err, UnsupportedModelError) and err.__cause__ is not None:
        err = err.__cause__
    return err


def _one_line(err: BaseException) -> str:
    root = _root(err)
    text = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(str(root).split()))
    outer = f"{type(err).__name__} <- " if root is not err else ""
    return f"{outer}{type(root).__name__}: {text}"[:400]


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(_root(err).__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


# One type's sweep runs in its own process: a type that hangs in tracing or asks for more memory than
# the machine has must cost its own row, not the whole sweep.
TYPE_SECONDS = 900
TYPE_MEMORY_BYTES = 16 * 2**30
REAL_MEMORY_BYTES = 21 * 2**30  # --real: one process at a time, real MoE layers are GBs


def sweep_isolated(model_type: str, targets: tuple[str, ...], real: bool = False, rtx: bool = False) -> dict[str, Any]:
    """sweep_one() (rtx: rtx_one()) in a child process with a time and address-space limit."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        cap = REAL_MEMORY_BYTES if real else TYPE_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    command = [sys.executable, "-m", "kvforge.tools.coverage_sweep", model_type, "--targets", ",".join(targets), "--row",
               *(["--real"] if real else []), *(["--rtx"] if rtx else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TYPE_SECONDS, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        if rtx:
            return {"status": "fail", "error": f"gave up after {TYPE_SECONDS} s"}
        return {"status": "refused", "reason": MISSING_FEATURES.get(model_type, "not yet diagnosed"),
                "error": f"the sweep gave up after {TYPE_SECONDS} s (export or parity hangs)", "targets": {}}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = " ".join(done.stderr.split()[-40:])
    why = "killed (out of memory?)" if done.returncode < 0 else f"exit {done.returncode}"
    if rtx:
        return {"status": "fail", "error": f"the build's process died: {why}: {tail}"[:200]}
    return {"status": "refused", "reason": MISSING_FEATURES.get(model_type, "not yet diagnosed"),
            "error": f"the sweep's process died: {why}: {tail}"[:400], "targets": {}}


def main(argv: list[str] | None = None) -> int:
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--targets", default=",".join(SWEEP_TARGETS))
    parser.add_argument("--write", action="store_true", help=f"merge the rows into {COVERAGE_FILE.name}")
    parser.add_argument("--out", type=Path, default=COVERAGE_FILE, help="the file --write merges into")
    parser.add_argument("--part", default="1/1", help="K/N: sweep the K-th of N interleaved slices (parallel runs)")
    parser.add_argument("--row", action="store_true", help="run one type here and print its row as JSON (internal)")
    parser.add_argument("--real", action="store_true", help="at each type's default layer shapes (one layer of each "
                        "kind, a small vocabulary); --write records the result as the row's `real` entry")
    parser.add_argument("--rtx", action="store_true", help="build TensorRT for RTX engines from each type's tiny "
                        "`onnx` export (default types: those that pass); --write records the row's `rtx` entry")
    args = parser.parse_args(argv)
    targets = tuple(args.targets.split(","))
    if args.write and not set(REQUIRED_TARGETS) <= set(targets):
        parser.error(f"--write records the registry's rows: --targets must include {' and '.join(REQUIRED_TARGETS)}")
    if args.row:
        print(json.dumps(rtx_one(args.types[0]) if args.rtx else sweep_one(args.types[0], targets, args.real)))
        return 0
    coverage = json.loads(args.out.read_text()) if args.out.is_file() else {"types": {}}
    if args.rtx:
        return _rtx_sweep(args, coverage)
    coverage["transformers"] = transformers.__version__
    part, parts = (int(x) for x in args.part.split("/"))
    for model_type in (args.types or causal_lm_types())[part - 1::parts]:
        started = time.perf_counter()
        row = (sweep_isolated(model_type, targets, args.real) if model_type not in OUT_OF_SCOPE
               else sweep_one(model_type))
        print(f"{model_type:28s} {row['status']:12s} {time.perf_counter() - started:6.1f}s "
              + json.dumps({t: (r["status"], r.get("max_abs_err"), r.get("error", "")[:160])
                            for t, r in row.get("targets", {}).items()} or row.get("error") or row.get("reason")),
              flush=True)
        if args.real:  # the registry's row stays the tiny sweep's; the real-shape check is an entry of it
            coverage["types"].setdefault(model_type, {})["real"] = real_summary(model_type, row)
        else:  # a tiny re-run keeps the row's real-shape and TensorRT-RTX entries
            previous = coverage["types"].get(model_type, {})
            coverage["types"][model_type] = {**row, **{key: previous[key] for key in ("real", "rtx") if key in previous}}
        if args.write:
            args.out.write_text(json.dumps(coverage, indent=1, sort_keys=True) + "\n")
    return 0


def _rtx_sweep(args: Any, coverage: dict[str, Any]) -> int:
    """--rtx: each type's `rtx` entry (rtx_one), into `coverage` (a type's other entries are kept)."""
    from kvforge.models.coverage_data import load_coverage

    passing = sorted(t for t, row in load_coverage()["types"].items() if row["status"] == "pass")
    part, parts = (int(x) for x in args.part.split("/"))
    for model_type in (args.types or passing)[part - 1::parts]:
        started = time.perf_counter()
        entry = sweep_isolated(model_type, (), rtx=True)
        print(f"{model_type:28s} rtx {entry['status']:10s} {time.perf_counter() - started:6.1f}s "
              f"{entry.get('attention') or entry.get('error', '')}", flush=True)
        coverage["types"].setdefault(model_type, {})["rtx"] = entry
        if args.write:
            args.out.write_text(json.dumps(coverage, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
