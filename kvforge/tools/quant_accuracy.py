"""The accuracy check of a quantised export (`kvforge export --quantize` / `--kv-cache`): the export against the fp32
model it came from, recorded in its manifest; an export whose figures are not finite is not kept."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import ExportError, InputError
from kvforge.core.manifest import load_manifest
from kvforge.tools.parity import PromptParity, first_difference, run_parity


def measure_quantized(folder: str | Path, model_dir: str | Path | None = None, hf_model: Any = None) -> dict[str, Any]:
    """A quantised export against the fp32 model it came from (Hugging Face eager, which the fp32
    export matches to ~1e-4): max logit error, greedy agreement over 32 tokens on kvforge's parity
    prompts, and perplexity on 1024 tokens of its fixed text. Recorded in the export's manifest as
    `quantization.accuracy`, or `kv_cache_quantization.accuracy` for an int8 KV cache with fp32 weights
    (measured on the published export, after the export wrote it)."""
    from kvforge.core.manifest import record_section

    folder = Path(folder)
    manifest = load_manifest(folder)
    section = "quantization" if manifest.get("quantization") else "kv_cache_quantization"
    if not manifest.get(section):
        raise InputError(f"{folder} is not a quantised export (it was exported without --quantize or --kv-cache)")
    model_dir = Path(model_dir if model_dir is not None else manifest["model"]["source"])
    report = run_parity(model_dir, folder, new_tokens=32, hf_model=hf_model)
    steps = sum(len(p.step_max_abs_err) for p in report.prompts)
    agree = sum(len(p.step_max_abs_err) - len(p.mismatched_steps) - len(p.tie_steps) for p in report.prompts)
    ppl = report.perplexity or {}
    accuracy = {"reference": "fp32 model (Hugging Face eager)", "max_abs_logit_err": round(float(report.max_abs_err), 4),
                "greedy_agreement": f"{agree}/{steps}", "perplexity": round(ppl.get("export", float("nan")), 4),
                "reference_perplexity": round(ppl.get("hf", float("nan")), 4),
                "perplexity_relative_increase": round(ppl.get("export", 0) / ppl.get("hf", 1) - 1, 5),
                "perplexity_tokens": ppl.get("tokens")}
    accuracy.update(answers_compared(report.prompts))
    record_section(folder, section, {**manifest[section], "accuracy": accuracy})
    return accuracy


def answers_compared(prompts: list[PromptParity]) -> dict[str, Any]:
    """Whether each prompt's whole greedy answer is the fp32 model's own. Greedy agreement counts the steps where
    the fp32 model, fed the export's own tokens so far, picks the same next token: after one tipped near-tie the
    answer goes elsewhere while that count stays high. A `note` says so where an answer parts."""
    answered = [p for p in prompts if p.error is None]
    parted = [p for p in answered if not p.generate_equal]
    figures: dict[str, Any] = {"answers_equal": f"{len(answered) - len(parted)}/{len(prompts)}"}
    if parted:
        first = parted[0]
        step = first_difference(first.export_tokens, first.hf_generate_tokens)
        margin = first.step_hf_margin[step] if step < len(first.step_hf_margin) else float("nan")
        figures["note"] = (f"{len(parted)} of {len(prompts)} check answers part from the fp32 model's own (first at "
                           f"token {step + 1}, where its top two tokens were {margin:.2f} logits apart): agreement counts "
                           "tokens on the export's path, so a tipped near-tie changes the rest of an answer. Try your "
                           "own prompts (kvforge parity; docs/quantisation.md)")
    return figures


# The accuracy figures that must be finite for a quantised export to be kept
FIGURES = ("max_abs_logit_err", "perplexity", "reference_perplexity", "perplexity_relative_increase")


def check_accuracy_runs(dtype: str, quantized: bool, check: bool | None) -> None:
    """Before an export is written: its accuracy check runs it on ONNX Runtime's CPU (the default backend), which has
    no bfloat16 kernels, so a quantised bf16 export is refused up front unless --no-accuracy-check."""
    if dtype == "bf16" and quantized and check is not False:
        raise InputError("a quantised --dtype bf16 export cannot be measured here: the export's accuracy check runs it "
                         "on ONNX Runtime's CPU, which has no bfloat16 kernels; add --no-accuracy-check (and measure it "
                         "on a GPU with `kvforge parity MODEL_DIR EXPORT_DIR --backend ort-cuda`), or use --dtype fp16")


def quantization_accuracy(out_dir: Path, record: dict[str, Any], check: bool | None,
                          progress: Callable[[str], None]) -> dict[str, Any]:
    """The quantisation's cost against the fp32 model, or why it was not measured: --no-accuracy-check, or
    (by default) an fp32 model that would not fit in half the memory free now."""
    if check is False:
        return {"skipped": "--no-accuracy-check"}
    parameters = record.get("parameters")
    free = _free_memory()
    if check is None and parameters and free and 4 * parameters > free / 2:
        return {"skipped": f"the fp32 reference model takes {4 * parameters / 1e9:.1f} GB and {free / 1e9:.1f} GB is free; "
                           "--accuracy-check measures it anyway, `kvforge parity` measures it later"}
    progress("measuring what quantisation costs against the fp32 model (logits, greedy tokens, perplexity)")
    if load_manifest(out_dir).get("encoder") is not None:  # an encoder-decoder: its decoder's logits
        from kvforge.core.manifest import record_section
        from kvforge.tools.seq2seq_accuracy import measure_seq2seq_quantized

        accuracy = measure_seq2seq_quantized(out_dir)
        record_section(out_dir, "quantization", {**record, "accuracy": accuracy})
    else:
        accuracy = measure_quantized(out_dir)
    broken = {k: accuracy[k] for k in FIGURES if k in accuracy and not np.isfinite(accuracy[k])}
    if broken:  # NaN or Inf logits: the export answers garbage, so it is not kept
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
        raise ExportError(f"the quantised export's accuracy check gave {', '.join(f'{k} {v}' for k, v in broken.items())}: "
                          f"its logits are not finite (a corrupt weight, or an overflow); {out_dir} was removed")
    return accuracy


def _free_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
