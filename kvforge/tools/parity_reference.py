"""The Hugging Face eager side of `kvforge parity`, computed live or once and handed to several runs.

A parity run asks HF eager three things: its own greedy generate() tokens for each prompt, its teacher-forced
logits over prompt + the export's tokens, and its log-probabilities on the perplexity windows. None of them depends
on the export's backend, target or session mode, so runs of several exports of one model (ort and onnx, shared and
single sessions) can share them:

    reference = hf_reference(model_dir, export_dir, new_tokens=32)
    run_parity(model_dir, export_dir, new_tokens=8, reference=reference)   # and other exports of the model

A reference answers only what it holds exactly as a run would compute it; anything else a run asks (an export's
tokens that leave HF's, so other teacher-forced inputs) is computed live with the reference's model. A reference of
another model folder, dtype, prompts, tokenization or perplexity text is refused, as is a run of more new tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.core.manifest import load_manifest

DEFAULT_PROMPTS = (
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
    "def main(): return 42",
)
# Perplexity on a fixed text shipped with kvforge (kvforge/data/perplexity.txt, ~3000 tokens of
# original prose), in independent windows, HF vs export. Tolerance on |ppl_export / ppl_hf - 1|.
PERPLEXITY_TEXT = Path(str(resources.files("kvforge") / "data" / "perplexity.txt"))
PERPLEXITY_WINDOW = 256
DEFAULT_PERPLEXITY_TOKENS = 1024


def _check_arguments(model_dir: str | Path, export_dir: str | Path, new_tokens: int, atol: float | None,
                     perplexity_tokens: int) -> None:
    """run_parity's arguments, each refused in one line before anything loads."""
    if new_tokens < 1:
        raise InputError(f"--new-tokens must be >= 1, got {new_tokens}")
    if atol is not None and not atol > 0:
        raise InputError(f"--atol must be > 0, got {atol}")
    if isinstance(perplexity_tokens, bool) or not isinstance(perplexity_tokens, int) or perplexity_tokens < 0:
        raise InputError(f"--perplexity-tokens must be an integer >= 0, got {perplexity_tokens!r}")
    if (Path(model_dir) / "kvforge.json").is_file() and not (Path(export_dir) / "kvforge.json").is_file():
        raise InputError(f"{model_dir} is a kvforge export and {export_dir} is not: the arguments are swapped? "
                         f"The order is MODEL_DIR EXPORT_DIR: kvforge parity {export_dir} {model_dir}")


def _scored(tokens: int) -> int:
    """How many of `tokens` consecutive tokens perplexity scores: all but each window's first (nothing before it
    to predict it from); a window of one token scores none and is dropped."""
    full, rest = divmod(tokens, PERPLEXITY_WINDOW)
    return full * (PERPLEXITY_WINDOW - 1) + max(rest - 1, 0)


def perplexity_windows(ids: list[int]) -> list[list[int]]:
    """The windows perplexity scores `ids` in (a window of one token scores nothing and is dropped)."""
    windows = [ids[i : i + PERPLEXITY_WINDOW] for i in range(0, len(ids), PERPLEXITY_WINDOW)]
    return [w for w in windows if len(w) >= 2]


@dataclass(frozen=True)
class ParityInputs:
    """What a parity run feeds Hugging Face eager: a reference must have been made from the same."""

    model_dir: Path  # MODEL_DIR as resolved (a Hub id's snapshot), absolute, links resolved
    fingerprint: str  # its files' names, sizes and modification times: the same path rewritten is another model
    hf_dir: Path  # the folder HF loads: MODEL_DIR, or a pre-quantised checkpoint's dequantised twin
    dtype: str
    pad_token_id: int
    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    new_tokens: int
    perplexity_ids: tuple[int, ...]  # empty: no perplexity


def folder_fingerprint(folder: Path) -> str:
    """A digest of the files directly in `folder` (name, size, modification time): cheap, and changed by any rewrite.
    An unreadable folder gives "" (the model load says what is wrong with it)."""
    digest = hashlib.sha256()
    try:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            stat = path.stat()
            digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    except OSError:
        return ""
    return digest.hexdigest()


def parity_inputs(model_dir: Path, hf_dir: Path, manifest: dict[str, Any], tokenizer: Any, prompts: list[str],
                  new_tokens: int, perplexity_tokens: int) -> ParityInputs:
    """The HF inputs of a run: the prompts and the perplexity text tokenized by the export's tokenizer."""
    perplexity = tokenizer.encode(PERPLEXITY_TEXT.read_text())[:perplexity_tokens] if perplexity_tokens else []
    return ParityInputs(Path(model_dir).resolve(), folder_fingerprint(Path(model_dir)), Path(hf_dir).resolve(),
                        manifest["dtype"], manifest["model"].get("pad_token_id") or 0, tuple(prompts),
                        tuple(tuple(tokenizer.encode(text)) for text in prompts), new_tokens, tuple(perplexity))


class LiveHF:
    """HF eager computed when asked: what a run without a reference does."""

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def generation_config(self, new_tokens: int) -> Any:
        """Greedy, `new_tokens` new tokens, no EOS of ours (transformers may still stop at the model's own)."""
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
                                pad_token_id=self.pad_token_id)

    def generate(self, ids: list[int], new_tokens: int) -> list[int]:
        """HF's own cached greedy generate() after the prompt `ids`."""
        import torch

        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), generation_config=self.generation_config(new_tokens))
        return out[0, len(ids):].tolist()

    def teacher_forced(self, ids: list[int], tokens: list[int]) -> np.ndarray:
        """HF's logits [len(tokens), V] at each step of prompt `ids` followed by `tokens`, in one forward pass."""
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :].float().numpy()

    def window_logprobs(self, window: list[int]) -> np.ndarray:
        """HF's log-probability of each token of a perplexity window after the ones before it."""
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([window])).logits[0, :-1].double()
        targets = torch.tensor(window[1:])[:, None]
        return torch.log_softmax(logits, dim=-1).gather(1, targets)[:, 0].numpy()


def generate_prefix_exact(model: Any) -> bool:
    """Whether the first n tokens of a greedy generate() of more are exactly what one of n gives: each step then does
    the same computation whatever max_new_tokens is (a DynamicCache; a static one is sized to max_length), and no
    processor forces EOS at max_length. EOS stops both runs at the same step. Unknown cache handling: not assumed."""
    config = model.generation_config
    dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    return (callable(dynamic) and bool(dynamic()) and getattr(config, "cache_implementation", None) in (None, "dynamic")
            and getattr(config, "forced_eos_token_id", None) is None)


@dataclass(frozen=True)
class HFReference:
    """Hugging Face eager's answers for one model, dtype, prompt set and perplexity text (hf_reference makes it)."""

    inputs: ParityInputs
    generated: tuple[tuple[int, ...], ...]  # HF generate() per prompt, up to inputs.new_tokens
    prefix_exact: bool  # generate_prefix_exact: a run of fewer new tokens may use `generated`'s prefixes
    teacher_forced: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = field(repr=False)  # (prompt, tokens)
    window_logprobs: dict[tuple[int, ...], np.ndarray] = field(repr=False)  # perplexity window -> log-probs
    model: Any = field(repr=False, compare=False)  # for what a run asks beyond these

    def check(self, run: ParityInputs) -> None:
        """Refuse, in one line, a run this reference was not made for."""
        ours = self.inputs
        if (run.model_dir, run.fingerprint, run.hf_dir) != (ours.model_dir, ours.fingerprint, ours.hf_dir):
            changed = " (its files changed since)" if run.model_dir == ours.model_dir else ""
            raise InputError(f"the Hugging Face reference was made from {ours.model_dir}{changed}, not {run.model_dir}: "
                             "make one with hf_reference() for this model folder")
        differ = [name for name in ("dtype", "pad_token_id", "prompts", "prompt_ids") if
                  getattr(run, name) != getattr(ours, name)]
        if run.perplexity_ids and run.perplexity_ids != ours.perplexity_ids:
            differ.append(f"perplexity text ({len(run.perplexity_ids)} tokens; the reference has "
                          f"{len(ours.perplexity_ids)})")
        if differ:
            raise InputError(f"the Hugging Face reference does not match this run: its {', '.join(differ)} differ "
                             "(prompt_ids: the export tokenizes the prompts otherwise)")
        if run.new_tokens > ours.new_tokens:
            raise InputError(f"the Hugging Face reference holds {ours.new_tokens} new tokens per prompt, and this run "
                             f"asks {run.new_tokens}: make it with new_tokens >= {run.new_tokens}")


class ReferencedHF(LiveHF):
    """A run's HF side answered from an HFReference where it holds exactly the answer, else computed live."""

    def __init__(self, reference: HFReference) -> None:
        super().__init__(reference.model, reference.inputs.pad_token_id)
        self.reference = reference

    def generate(self, ids: list[int], new_tokens: int) -> list[int]:
        ref = self.reference
        k = ref.inputs.prompt_ids.index(tuple(ids))
        if new_tokens == ref.inputs.new_tokens or ref.prefix_exact:
            return list(ref.generated[k][:new_tokens])
        return super().generate(ids, new_tokens)

    def teacher_forced(self, ids: list[int], tokens: list[int]) -> np.ndarray:
        # Held for this prompt and exactly these tokens: the same forward pass. Fewer tokens are another pass (another
        # shape, whose floats may differ in the last bits), so they are computed.
        held = self.reference.teacher_forced.get((tuple(ids), tuple(tokens)))
        return held.copy() if held is not None else super().teacher_forced(ids, tokens)

    def window_logprobs(self, window: list[int]) -> np.ndarray:
        held = self.reference.window_logprobs.get(tuple(window))
        return held.copy() if held is not None else super().window_logprobs(window)


def hf_side(run: ParityInputs, hf_dir: Path, reference: HFReference | None, hf_model: Any,
            say: Callable[[str], None]) -> LiveHF:
    """A run's HF side: the reference (checked against the run first), else `hf_model` or the model loaded from
    `hf_dir` (run.hf_dir as the caller named it)."""
    if reference is not None:
        if hf_model is not None:
            raise InputError("pass hf_model to hf_reference(), not to a run given a reference")
        reference.check(run)
        say(f"Hugging Face eager reference from {run.hf_dir}: reused")
        return ReferencedHF(reference)
    if hf_model is None:
        from kvforge.exporter.load import load_hf_model

        say(f"loading Hugging Face eager reference from {hf_dir} ({run.dtype})")
    return LiveHF(hf_model if hf_model is not None else load_hf_model(hf_dir, run.dtype), run.pad_token_id)


def hf_reference(model_dir: str | Path, export_dir: str | Path, prompts: list[str] | None = None, new_tokens: int = 32,
                 perplexity_tokens: int = DEFAULT_PERPLEXITY_TOKENS, hf_model: Any = None,
                 progress: Callable[[str], None] | None = None) -> HFReference:
    """HF eager's side of run_parity(model_dir, export_dir, prompts, new_tokens, perplexity_tokens=...) computed once
    (`export_dir`: any export of the model, for its tokenizer and dtype), for runs of that model's exports with the
    same prompts and perplexity text and at most `new_tokens` new tokens to pass as `reference=`."""
    from kvforge.exporter.quantization.prequantized_convert import dequantised_twin
    from kvforge.models.hub import resolve_model
    from kvforge.runtime.text.tokenizer import TOKENIZER_FILE, Tokenizer
    from kvforge.tools.parity_model import check_same_model

    say = progress or (lambda _msg: None)
    model_dir = resolve_model(model_dir, say=say)
    _check_arguments(model_dir, export_dir, new_tokens, None, perplexity_tokens)
    manifest = load_manifest(export_dir)
    check_same_model(Path(model_dir), manifest, Path(export_dir))
    if not (Path(export_dir) / TOKENIZER_FILE).is_file():
        raise InputError(f"{export_dir} has no tokenizer.json; parity needs text prompts it can tokenize")
    hf_dir = dequantised_twin(Path(model_dir), manifest, say)
    run = parity_inputs(model_dir, hf_dir, manifest, Tokenizer(export_dir), list(prompts or DEFAULT_PROMPTS),
                        new_tokens, perplexity_tokens)
    live = hf_side(run, hf_dir, None, hf_model, say)
    generated, teacher = [], {}
    for ids in run.prompt_ids:
        tokens = live.generate(list(ids), new_tokens)
        generated.append(tuple(tokens))
        if len(tokens) == new_tokens:  # stopped early at EOS: an export's tokens run on, so no run asks this input
            teacher[ids, tuple(tokens)] = live.teacher_forced(list(ids), tokens)
    windows = {tuple(w): live.window_logprobs(w) for w in perplexity_windows(list(run.perplexity_ids))}
    return HFReference(run, tuple(generated), generate_prefix_exact(live.model), teacher, windows, live.model)
