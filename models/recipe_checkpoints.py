"""A recipe's folder as a pre-quantised checkpoint, made by the quantisation library itself, so an import
(docs/quantisation.md, "Pre-quantised checkpoints") can be tried offline: `kvforge export --recipe
llama-tiny-autoround -o OUT`. AutoRound (Intel's auto-round, in the `export` extra) tunes the recipe's random
weights on a few windows of kvforge's calibration text for a couple of steps a block (seconds on a CPU: the
point is the checkpoint's layout, not its accuracy) and writes them packed as `auto_round:auto_gptq`, as a
published AutoRound checkpoint is."""

from __future__ import annotations

import functools
import logging
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError

METHODS = ("auto-round",)
# Enough to run AutoRound's whole path (calibration, tuning, packing) quickly; not a calibration to measure.
_SAMPLES, _SEQUENCE, _ITERATIONS, _GROUP = 4, 32, 2, 32


def prequantise(method: str, model: Any, tokenizer: Any, folder: Path) -> None:
    """Replace the fp32 checkpoint in `folder` (config.json, model.safetensors) with `model` quantised by
    `method`'s library: its packed integers and its quantization_config."""
    if method not in METHODS:
        raise InputError(f"unknown pre-quantisation method {method!r}; choose one of {', '.join(METHODS)}")
    try:
        import auto_round.compressors.orchestrator as orchestrator
        from auto_round import AutoRound
    except ImportError:
        raise InputError("this recipe is made with the auto-round package: pip install 'kvforge[export]'") from None
    # kvforge's calibration text (the one exporter/quantization/autoround.py reads), from the package's data
    ids = tokenizer.encode((resources.files("kvforge") / "data" / "calibration.txt").read_text(encoding="utf-8"))
    samples = [tokenizer.decode(ids[k * _SEQUENCE:(k + 1) * _SEQUENCE]) for k in range(_SAMPLES)]
    work = folder / "autoround-work"
    # Its INFO lines (tuning times, peak RAM) and progress bars are not the recipe's to say: the build is one step.
    quiet, bars = logging.getLogger("autoround"), orchestrator.tqdm
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    orchestrator.tqdm = functools.partial(bars, disable=True)
    try:
        quantizer = AutoRound(model, tokenizer, scheme="W4A16", bits=4, group_size=_GROUP, sym=True, dataset=samples,
                              iters=_ITERATIONS, nsamples=_SAMPLES, seqlen=_SEQUENCE, batch_size=2, device_map="cpu",
                              enable_torch_compile=False, seed=0)
        quantizer.quantize_and_save(str(work), format="auto_round")
    finally:
        quiet.setLevel(level)
        orchestrator.tqdm = bars
    written = next(path.parent for path in work.rglob("config.json"))
    for fp32 in folder.glob("*.safetensors*"):
        fp32.unlink()
    for path in [*written.glob("*.safetensors*"), written / "config.json", written / "quantization_config.json"]:
        if path.is_file():
            shutil.move(str(path), str(folder / path.name))
    shutil.rmtree(work)
