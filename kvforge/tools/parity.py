"""`kvforge parity`: the same prompts through Hugging Face eager and through an export.

For every prompt the export generates `new_tokens` greedy tokens (EOS ignored, so every run is
the same length). Hugging Face eager then scores prompt + those tokens in one forward pass: at
each step we compare the export's logits with HF's (max abs error) and the export's token with
HF's argmax (greedy agreement, teacher-forced so one early flip does not hide later steps).
HF's own cached `generate` must also produce exactly the export's tokens.

Tolerances (max abs logit error per step): fp32 1e-3, fp16 0.15, bf16 0.5 (bf16 keeps 8 mantissa bits
against fp16's 11; no backend here runs bf16 yet). A token mismatch fails the gate
unless HF's own top-2 margin at that step is below 2 x atol (a numerical tie, reported as such).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.core.errors import InputError, NumericalError
from kvforge.core.manifest import load_manifest
from kvforge.tools.parity_reference import (  # noqa: F401  (DEFAULT_PROMPTS, PERPLEXITY_TEXT, PERPLEXITY_WINDOW: read from here)
    DEFAULT_PERPLEXITY_TOKENS,
    DEFAULT_PROMPTS,
    PERPLEXITY_TEXT,
    PERPLEXITY_WINDOW,
    _check_arguments,
    _scored,
    perplexity_windows,
)

if TYPE_CHECKING:
    from kvforge.tools.parity_reference import HFReference, LiveHF

DEFAULT_ATOL = {"fp32": 1e-3, "fp16": 0.15, "bf16": 0.5}
PERPLEXITY_RTOL = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 5e-2}
# A weight-quantised export is not expected to give HF's logits or every greedy token: it passes when
# its perplexity on the shipped text is at most this much above HF's (fp32); logit error and greedy
# agreement are reported, not gated.
# Round-to-nearest int4 costs small models much (SmolLM2-135M-Instruct: +21.8% all-int4, +13.3% with
# an int8 lm_head; int8: +0.5%), so the int4 gate catches a broken quantisation, not RTN's usual cost.
QUANTIZED_PERPLEXITY_RISE = {8: 0.02, 4: 0.30}


@dataclass
class PromptParity:
    prompt: str
    prompt_tokens: int
    export_tokens: list[int]
    hf_generate_tokens: list[int]
    step_max_abs_err: list[float]
    step_hf_margin: list[float]
    mismatched_steps: list[int]
    tie_steps: list[int]
    error: str | None = None  # the export could not produce this prompt's logits (NaN, ...)
    # --against BACKEND: that backend's tokens, and the max logit error between the two backends per
    # step up to their first token difference (after it they see different histories).
    against_tokens: list[int] | None = None
    against_step_max_abs_err: list[float] | None = None
    hf_stopped_at_eos: bool = False

    @property
    def max_abs_err(self) -> float:
        return max(self.step_max_abs_err) if self.step_max_abs_err else float("nan")

    @property
    def generate_equal(self) -> bool:
        """HF's own generate() gave the export's tokens (up to an end-of-sequence token where HF's
        generate stops: transformers fills an unset eos_token_id from the model's generation
        config, while the export is run past EOS so every prompt has the same length)."""
        hf, ours = self.hf_generate_tokens, self.export_tokens
        return hf == ours or (self.hf_stopped_at_eos and len(hf) < len(ours) and hf == ours[: len(hf)])


@dataclass
class ParityReport:
    export_dir: str
    target: str
    dtype: str
    backend: str
    sessions: str | None
    atol: float
    new_tokens: int
    prompts: list[PromptParity] = field(default_factory=list)
    against: str | None = None
    perplexity: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None  # the manifest's: {"bits", "block_size", ...}

    @property
    def max_abs_err(self) -> float:
        errors = [p.max_abs_err for p in self.prompts]
        return float("nan") if any(np.isnan(e) for e in errors) else max(errors)

    @property
    def passed(self) -> bool:
        return self.failure_reason() == ""

    def failure_reason(self) -> str:
        reasons = []
        nan = False
        for i, p in enumerate(self.prompts, 1):  # numbered from 1, as the progress lines ("prompt 1 of 3") are
            nan_steps = [step for step, err in enumerate(p.step_max_abs_err) if np.isnan(err)]
            if p.error is not None:
                reasons.append(f"prompt {i}: {p.error}")
                nan = nan or "NaN" in p.error
            elif nan_steps:
                reasons.append(f"prompt {i}: the export's logits are NaN at steps {nan_steps}")
                nan = True
            elif p.max_abs_err > self.atol and self.quantization is None:
                step = int(np.argmax(p.step_max_abs_err))
                reasons.append(f"prompt {i}: max logit error {p.max_abs_err:.3g} > atol {self.atol:g} (step {step})")
            if p.against_tokens is not None:
                against_err = max(p.against_step_max_abs_err or [0.0])
                if p.against_tokens != p.export_tokens:
                    first = first_difference(p.against_tokens, p.export_tokens)
                    reasons.append(f"prompt {i}: {self.against} gives different tokens from step {first}")
                if against_err > self.atol:
                    reasons.append(f"prompt {i}: logits differ from {self.against} by {against_err:.3g} > atol {self.atol:g}")
            if self.quantization is not None:
                continue
            if p.error is None and p.mismatched_steps:
                reasons.append(f"prompt {i}: greedy token differs from HF at steps {p.mismatched_steps}")
            elif p.error is None and not p.generate_equal and not p.tie_steps:
                reasons.append(f"prompt {i}: HF generate() tokens differ from the export's")
        ppl = self.perplexity
        if self.quantization is not None and ppl is not None:
            rise = ppl["export"] / ppl["hf"] - 1.0
            if not rise <= ppl["tolerance"]:
                reasons.append(f"perplexity {ppl['export']:.4g} vs HF {ppl['hf']:.4g}: the {self.quantization['bits']}-bit "
                               f"export's is {100 * rise:.2f}% higher, more than the {100 * ppl['tolerance']:g}% allowed")
        elif ppl is not None and not ppl["relative_difference"] <= ppl["tolerance"]:
            reasons.append(f"perplexity {ppl['export']:.4g} vs HF {ppl['hf']:.4g}: relative difference "
                           f"{ppl['relative_difference']:.3g} > {ppl['tolerance']:g}")
        if nan:
            reasons.append("NaN logits mean corrupted weights or an overflow in a low-precision export: "
                           f"check the folder with `kvforge inspect {self.export_dir} --verify`")
        return "; ".join(reasons)

    def summary(self) -> str:
        lines = [f"parity {self.export_dir} (target {self.target}, {self.dtype}, {self.backend}, sessions {self.sessions}, "
                 f"{self.new_tokens} new tokens, atol {self.atol:g})"]
        if self.quantization is not None:
            lines.append(f"  weights quantised to int{self.quantization['bits']} (blocks of {self.quantization['block_size']}): "
                         "gated on perplexity only; logit error and greedy agreement are reported, not gated")
        for i, p in enumerate(self.prompts, 1):  # numbered from 1, as the progress lines ("prompt 1 of 3") are
            if p.error is not None:
                lines.append(f"  prompt {i} ({p.prompt_tokens} tokens): {p.error}")
                continue
            agree = self.new_tokens - len(p.mismatched_steps) - len(p.tie_steps)
            lines.append(
                f"  prompt {i} ({p.prompt_tokens} tokens): max logit err {p.max_abs_err:.3g}, "
                f"greedy agreement {agree}/{self.new_tokens}"
                + (f" (+{len(p.tie_steps)} numerical ties)" if p.tie_steps else "")
                + f", HF generate equal: {'yes' if p.generate_equal else 'no'}"
                + (f"; vs {self.against}: max logit err {max(p.against_step_max_abs_err or [0.0]):.3g}, "
                   f"tokens equal: {'yes' if p.against_tokens == p.export_tokens else 'no'}"
                   if p.against_tokens is not None else "")
            )
        if self.perplexity is not None:
            ppl = self.perplexity
            lines.append(f"  perplexity on {ppl['tokens']} scored tokens (the first {ppl['text_tokens']} of {ppl['text']}, "
                         f"windows of {ppl['window']}): "
                         f"export {ppl['export']:.4f}, HF {ppl['hf']:.4f}, relative difference "
                         f"{ppl['relative_difference']:.2e} (tolerance {ppl['tolerance']:g}"
                         + (", a rise over HF" if self.quantization is not None else "") + ")")
        lines.append("PASS" if self.passed else f"FAIL: {self.failure_reason()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for prompt in data["prompts"]:  # JSON has no NaN: a NaN error is reported as null
            prompt["step_max_abs_err"] = [None if np.isnan(e) else e for e in prompt["step_max_abs_err"]]
        data["passed"] = self.passed
        data["max_abs_err"] = None if np.isnan(self.max_abs_err) else self.max_abs_err
        data["failure"] = self.failure_reason() or None
        return data


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first step where two token lists differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def lossy_quantization(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """What makes an export's logits differ from HF's by design: its weight quantisation (manifest
    `quantization`), else an int8 KV cache (`kv_cache_quantization`, gated as 8 bits), else None."""
    kv = manifest.get("kv_cache_quantization")
    if manifest.get("quantization") is not None:
        quantization = {**manifest["quantization"], **({"kv_cache": kv["dtype"]} if kv else {})}
        carried = quantization.get("integer_weights") or {}
        if carried.get("source") not in (None, "gguf") and not carried.get("rounded"):
            # A pre-quantised checkpoint's integers are its reference's own: only the products' int8
            # activations (accuracy level 4) differ, so it is gated as 8 bits are
            quantization["gate_bits"] = 8
        return quantization
    return {"bits": 8, "kv_cache": kv["dtype"]} if kv else None


def run_parity(
    model_dir: str | Path,
    export_dir: str | Path,
    prompts: list[str] | None = None,
    new_tokens: int = 32,
    atol: float | None = None,
    backend: str | None = None,
    progress: Callable[[str], None] | None = None,
    sessions: str | None = None,
    against: str | None = None,
    backend_options: dict[str, Any] | None = None,
    perplexity_tokens: int = DEFAULT_PERPLEXITY_TOKENS,
    hf_model: Any = None,
    reference: HFReference | None = None,
) -> ParityReport:
    """Check `backend` (default: what `kvforge generate` runs, the export's default backend in its
    default session mode) against Hugging Face eager; `sessions` picks an ONNX Runtime session mode
    ("shared" runs decode.onnx too); `against` also compares with another backend; the perplexity of
    the first `perplexity_tokens` tokens of the shipped text is compared too (0 skips it). `reference`
    (parity_reference.hf_reference): HF eager's side computed once for this model, checked to be this run's."""
    from kvforge.models.hub import resolve_model
    from kvforge.runtime import Generator
    from kvforge.tools.parity_model import check_same_model
    from kvforge.tools.parity_reference import hf_side, parity_inputs

    say = progress or (lambda _msg: None)
    model_dir = resolve_model(model_dir, say=say)  # a Hub id (org/name): its snapshot in huggingface_hub's cache
    _check_arguments(model_dir, export_dir, new_tokens, atol, perplexity_tokens)
    check_same_model(Path(model_dir), load_manifest(export_dir), Path(export_dir))
    from kvforge.exporter.quantization.prequantized_convert import dequantised_twin

    hf_dir = dequantised_twin(Path(model_dir), load_manifest(export_dir), say)
    quantization = lossy_quantization(load_manifest(export_dir))
    if quantization is not None and perplexity_tokens < 2:
        raise InputError(f"{export_dir} is quantised to int{quantization['bits']}; its parity gate is perplexity, "
                         "so --perplexity-tokens must be at least 2 (default 1024)")
    options = dict(backend_options or {})
    if sessions is not None:
        options["sessions"] = sessions
    generator = Generator(export_dir, backend=backend, **options)
    other = Generator(export_dir, backend=against) if against is not None else None
    backend = generator.backend_name
    manifest = generator.manifest
    if generator.tokenizer is None:
        raise InputError(f"{export_dir} has no tokenizer.json; parity needs text prompts it can tokenize")
    dtype = manifest["dtype"]
    atol = DEFAULT_ATOL[dtype] if atol is None else atol
    texts = list(prompts or DEFAULT_PROMPTS)
    run = parity_inputs(model_dir, hf_dir, manifest, generator.tokenizer, texts, new_tokens, perplexity_tokens)
    hf = hf_side(run, hf_dir, reference, hf_model, say)
    report = ParityReport(str(export_dir), manifest["target"], dtype, backend,
                          getattr(generator.backend, "session_mode", None), atol, new_tokens,
                          against=other.backend_name if other is not None else None, quantization=quantization)
    began = time.perf_counter()
    for k, text in enumerate(texts):
        ids = list(run.prompt_ids[k])
        # After the first prompt, an estimate from the prompts so far (they take alike: new_tokens steps each).
        left = (time.perf_counter() - began) / k * (len(texts) - k) if k else None
        say(f"prompt {k + 1} of {len(texts)} ({len(ids)} tokens, {text[:40]!r}"
            + (f"; about {left:.0f} s of prompts left" if left is not None else "") + ")")
        report.prompts.append(_prompt_parity(generator, other, hf, text, ids, new_tokens, atol))
    if perplexity_tokens:
        ids = list(run.perplexity_ids)
        say(f"perplexity on the first {len(ids)} tokens of {PERPLEXITY_TEXT.name}, in windows of {PERPLEXITY_WINDOW} "
            f"(each window's first token is context, not scored: {_scored(len(ids))} scored)")
        report.perplexity = _perplexity(generator, hf, ids, dtype)
        if quantization is not None:
            report.perplexity["tolerance"] = QUANTIZED_PERPLEXITY_RISE[int(quantization.get("gate_bits",
                                                                                       quantization["bits"]))]
    return report


def _prompt_parity(generator: Any, other: Any, hf: LiveHF, text: str, ids: list[int], new_tokens: int,
                   atol: float) -> PromptParity:
    """One prompt: the export's greedy tokens and logits against HF eager's teacher-forced logits and its
    own cached generate; with `other`, that backend's tokens and logits against the export's."""
    from kvforge.runtime import GenerationRequest

    try:
        request = GenerationRequest([ids], new_tokens, ignore_eos=True, keep_logits=True)  # greedy
        result = generator.generate(request)
    except NumericalError as err:
        return PromptParity(text, len(ids), [], [], [], [], [], [], error=f"the export's logits are NaN at step {err.step}")
    tokens = result.tokens[0]
    export_logits = np.stack([step[0] for step in result.logits]).astype(np.float32)  # [N, V]
    ref = hf.teacher_forced(ids, tokens)  # [N, V]
    generated = hf.generate(ids, new_tokens)
    err = np.abs(export_logits - ref).max(axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    hf_argmax = ref.argmax(axis=-1)
    mismatched, ties = [], []
    for step, token in enumerate(tokens):
        if token != int(hf_argmax[step]):
            (ties if margin[step] < 2 * atol else mismatched).append(step)
    entry = PromptParity(text, len(ids), tokens, generated, err.round(8).tolist(), margin.round(6).tolist(),
                         mismatched, ties)
    entry.hf_stopped_at_eos = bool(generated) and len(generated) < len(tokens) and generated[-1] in generator.eos_token_ids
    if other is not None:
        theirs = other.generate(request)
        same = min(first_difference(theirs.tokens[0], tokens), len(tokens) - 1)
        their_logits = np.stack([step[0] for step in theirs.logits[: same + 1]]).astype(np.float32)
        entry.against_tokens = theirs.tokens[0]
        entry.against_step_max_abs_err = np.abs(their_logits - export_logits[: same + 1]).max(axis=-1).round(8).tolist()
    return entry


def _perplexity(generator: Any, hf: LiveHF, ids: list[int], dtype: str) -> dict[str, Any]:
    """Perplexity of the export and of HF eager on the same windows of `ids` (the shipped text's first tokens)."""
    windows = perplexity_windows(ids)
    ours, theirs = [], []
    for window in windows:
        try:
            ours.append(generator.score(window))
        except NumericalError:
            ours.append(np.full(len(window) - 1, np.nan))
        theirs.append(hf.window_logprobs(window))
    export_ppl = float(np.exp(-np.concatenate(ours).mean()))
    hf_ppl = float(np.exp(-np.concatenate(theirs).mean()))
    return {
        "text": PERPLEXITY_TEXT.name, "text_tokens": len(ids), "tokens": int(sum(len(w) - 1 for w in windows)),
        "window": PERPLEXITY_WINDOW,
        "export": export_ppl, "hf": hf_ppl, "relative_difference": abs(export_ppl / hf_ppl - 1.0),
        "tolerance": PERPLEXITY_RTOL[dtype],
    }
