"""Calibrated int4 with AutoRound (Intel's auto-round library): each decoder block's rounding and its
blocks' ranges tuned on calibration text so the block's output stays close to the fp32 model's, then
carried into MatMulNBits as its integers (asymmetric blocks with integer zero points: ONNX Runtime's fast
CPU kernels; see docs/quantisation.md for what it keeps and costs against rounding to nearest).

The calibration text is kvforge's own (kvforge/data/calibration.txt: original prose, code and dialogue,
~2,400 tokens, not the perplexity text it is measured on) or `--calibration FILE`. Nothing is downloaded.
AutoRound runs on the fp32 model in torch, block by block, on the CPU; its result is written to a work
folder beside the export and read from there as a pre-quantised checkpoint is (kvforge.exporter.quantization.prequantized),
the lm_head and the embedding left to kvforge's own rounding (an 8-bit lm_head under 1B parameters).
"""

from __future__ import annotations

import codecs
import json
import logging
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from kvforge.core.errors import ExportError, InputError

CALIBRATION_TEXT = Path(str(resources.files("kvforge") / "data" / "calibration.txt"))
SEQUENCE = 256  # tokens a calibration sample
SAMPLES = 16  # samples, drawn as evenly spaced windows of the text
ITERATIONS = 200  # AutoRound's tuning steps a block (its default)
MIN_TOKENS = 512
# Bytes of --calibration read: ~250k tokens of prose, far more than the SAMPLES * SEQUENCE windows use
READ_BYTES = 2**20
STEPS_TIMED = 10  # tuning steps timed before the estimate of the whole calibration is said
MEASURED = "docs/quantisation.md measured 10-14 minutes for SmolLM2-135M's 30 blocks on 2 cores"


def read_calibration(path: str | Path | None) -> tuple[str, str]:
    """The calibration text and what to call it; a file that is empty, binary or not UTF-8 is refused in one line.
    Only its first READ_BYTES are read (calibration uses SAMPLES * SEQUENCE tokens): a huge file, or a device
    such as /dev/zero, is not read whole."""
    if path is None:
        return CALIBRATION_TEXT.read_text(encoding="utf-8"), "kvforge's calibration text"
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(READ_BYTES + 1)
    except OSError as err:
        raise InputError(f"--calibration {path}: cannot read it ({err.strerror or err})") from None
    what, cut = f"--calibration {path}", len(raw) > READ_BYTES
    if cut:
        raw, what = raw[:READ_BYTES], f"the first {READ_BYTES // 2**20} MiB of --calibration {path}"
    if not raw.strip():
        raise InputError(f"--calibration {path} is empty: give a text file of at least {MIN_TOKENS} tokens")
    try:  # not final: a character the cut splits at the end is dropped, not refused
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=not cut)
    except UnicodeDecodeError:
        raise InputError(f"--calibration {path} is not UTF-8 text (a binary file?): give plain text") from None
    if "\x00" in text:
        raise InputError(f"--calibration {path} holds NUL bytes (a binary file?): give plain text")
    return text, what


def windows(ids: list[int], what: str) -> list[list[int]]:
    """SAMPLES evenly spaced windows of SEQUENCE tokens (overlapping where the text is short)."""
    if len(ids) < MIN_TOKENS:
        raise InputError(f"{what} holds {len(ids)} tokens; calibration needs at least {MIN_TOKENS}")
    last = len(ids) - SEQUENCE
    starts = sorted({round(i * last / (SAMPLES - 1)) for i in range(SAMPLES)})
    return [ids[s:s + SEQUENCE] for s in starts]


class _Progress:
    """AutoRound's block loop reports through tqdm; this says each block as a progress line instead."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say

    def __call__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        say = self.say

        class Bar:
            def __init__(self) -> None:
                self.items = list(iterable) if iterable is not None else []
                self.done, self.began = 0, time.perf_counter()

            def __iter__(self):  # noqa: ANN204
                return iter(self.items)

            def set_description(self, text: str) -> None:
                if text.startswith("Quantizing ") and text != "Quantizing done":
                    left = ""
                    if self.done:  # from the blocks so far (alike in a decoder)
                        seconds = (time.perf_counter() - self.began) / self.done * (len(self.items) - self.done)
                        left = f"; about {seconds / 60:.0f} min left" if seconds >= 90 else f"; about {seconds:.0f} s left"
                    say(f"calibrating: {text[len('Quantizing '):]} ({self.done + 1} of {len(self.items)}{left})")

            def update(self, n: int = 1) -> None:
                self.done += n

            def close(self) -> None:
                pass

            def refresh(self) -> None:
                pass

        return Bar()


class _StepClock:
    """Times AutoRound's first tuning steps (SignRoundQuantizer._step runs once a step) and says, after STEPS_TIMED
    of them, about how long every block's steps take at that pace: an estimate within seconds, where the block
    progress line's waits for a whole block (minutes on a real model)."""

    def __init__(self, blocks: int, say: Callable[[str], None]) -> None:
        self.blocks, self.say, self.times = blocks, say, []
        self.owner: Any = None
        self.timed = max(1, min(STEPS_TIMED, ITERATIONS - 1))

    def tick(self) -> None:
        if len(self.times) > self.timed:
            return
        self.times.append(time.perf_counter())
        if len(self.times) == self.timed + 1:  # from the first step's end: a block's set-up is not counted
            step = (self.times[-1] - self.times[0]) / self.timed
            total = step * ITERATIONS * self.blocks
            pace = f"about {total / 60:.0f} min" if total >= 90 else f"about {total:.0f} s"
            self.say(f"AutoRound's tuning steps take {step:.2f} s each here: {pace} for the {self.blocks} blocks' "
                     f"{ITERATIONS} steps (less where a block stops improving early)")

    def __enter__(self) -> _StepClock:
        try:
            from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
        except ImportError:  # another auto-round layout: no estimate, the block lines still come
            return self
        self.owner, self.saved, clock = SignRoundQuantizer, SignRoundQuantizer._step, self

        def step(quantizer: Any, *args: Any, **kwargs: Any) -> Any:
            clock.tick()
            return clock.saved(quantizer, *args, **kwargs)

        SignRoundQuantizer._step = step
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owner is not None:
            self.owner._step = self.saved


def calibrate(model_dir: Path, bits: int, block_size: int, calibration: str | Path | None, work: Path,
              say: Callable[[str], None]) -> Any:
    """AutoRound on the fp32 model of `model_dir`: its integer weights as a source the export carries over
    (kvforge.exporter.quantization.prequantized.PrequantizedWeights read from `work`)."""
    text, what = read_calibration(calibration)
    try:
        import auto_round.compressors.orchestrator as orchestrator
        from auto_round import AutoRound
    except ImportError:
        raise InputError("--quant-method autoround needs the auto-round package: pip install 'kvforge[export]' "
                         "(or --quant-method rtn)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvforge.exporter.quantization.prequantized import PrequantizedWeights, layout_of

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    samples = [tokenizer.decode(w) for w in windows(tokenizer.encode(text), what)]
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # kvforge reports its own progress
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    blocks = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    say(f"calibrating int4 with AutoRound on {what}: {len(samples)} samples of {SEQUENCE} tokens, {ITERATIONS} "
        f"tuning steps for each of {blocks} blocks ({MEASURED}; an estimate for this model follows its first steps)")
    saved_tqdm, quiet = orchestrator.tqdm, logging.getLogger("autoround")
    level = quiet.level
    orchestrator.tqdm, _ = _Progress(say), quiet.setLevel(logging.ERROR)
    try:
        with _StepClock(blocks, say):
            quantizer = AutoRound(model, tokenizer, scheme="W4A16", bits=bits, group_size=block_size, sym=False,
                                  dataset=samples, iters=ITERATIONS, nsamples=len(samples), seqlen=SEQUENCE,
                                  batch_size=4, device_map="cpu", enable_torch_compile=False, seed=0)
            quantizer.quantize_and_save(str(work), format="auto_round")
    except Exception as err:  # the library raises its own types for models it cannot walk
        raise ExportError(f"AutoRound could not calibrate {model_dir.name}: {type(err).__name__}: "
                          f"{' '.join(str(err).split())}; --quant-method rtn rounds instead") from err
    finally:
        orchestrator.tqdm = saved_tqdm
        quiet.setLevel(level)
    folder = next(p.parent for p in Path(work).rglob("config.json"))
    layout = layout_of(json.loads((folder / "config.json").read_text())["quantization_config"], str(folder))
    source = PrequantizedWeights(folder, layout)
    source.kind, source.rounds_the_rest = "AutoRound calibration", True
    return source
