"""A checkpoint's tensor names held to its model's: a tensor the model needs that the checkpoint lacks, one the
checkpoint holds that the model has no place for, or one of another shape refuses the export in one line naming it.

transformers fills a missing parameter with random values (and drops an unexpected tensor) with a warning only, so
an export of that model would answer garbage with exit 0. The streamed path compares names itself
(exporter/lazy_weights.py: `unexpected_tensors`); the whole-model path reads transformers' own loading report
(exporter/load.py and models/gguf.py: `refuse_incomplete`), with transformers' own rules for tensors a model ignores.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError

# The markers of the folders kvforge converts a user's checkpoint into (each records its "source")
GGUF_MARKER = "kvforge_gguf.json"  # a GGUF's Hugging Face conversion (models/gguf.py)
PREQUANTIZED_MARKER = "kvforge_prequantized.json"  # a pre-quantised checkpoint's dequantised twin (exporter/quantization/prequantized.py)


def checkpoint_in(model_dir: Path) -> str:
    """"the checkpoint in FOLDER", naming the user's own checkpoint where `model_dir` is a folder kvforge made from it
    (a pre-quantised checkpoint's dequantised twin, a GGUF's conversion: their markers record the source)."""
    for marker in (PREQUANTIZED_MARKER, GGUF_MARKER):
        try:
            source = json.loads((Path(model_dir) / marker).read_text())["source"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return f"the checkpoint {source} (as converted for export)"
    return f"the checkpoint in {model_dir}"


def ignored_unexpected(model: Any) -> re.Pattern[str] | None:
    """The checkpoint tensors transformers drops without a word for `model`: its class's
    `_keys_to_ignore_on_load_unexpected`, and the rotary `inv_freq` / `position_ids` buffers old checkpoints saved
    (as transformers' `_adjust_missing_and_unexpected_keys` allows them)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    from kvforge.models.mtp import mtp_tensor_pattern

    mtp = mtp_tensor_pattern(getattr(model, "config", None))  # MTP layers: draft.onnx's (exporter/mtp_head.py)
    if mtp is not None:
        patterns.add(mtp)
    return re.compile("|".join(f"({pattern})" for pattern in sorted(patterns))) if patterns else None


def unexpected_tensors(model: Any, names: Iterable[str], used: set[str]) -> list[str]:
    """The checkpoint `names` no parameter or buffer of `model` reads (`used`) and transformers would not ignore."""
    ignored = ignored_unexpected(model)
    return sorted(name for name in names if name not in used and (ignored is None or ignored.search(name) is None))


def refuse_unexpected(model_dir: Path, model: Any, unexpected: list[str]) -> None:
    """One line naming the first tensor of the checkpoint the model has no place for (InputError); none: nothing."""
    if not unexpected:
        return
    more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    raise InputError(
        f"{checkpoint_in(model_dir)} holds {unexpected[0]}{more}, which {type(model).__name__} (its config.json) has "
        "no place for: the weights are not this config's model, so the export would drop them; fix config.json or "
        "the weights (download or save the folder again)")


def missing_line(model_dir: Path, missing: list[str]) -> str:
    """What a checkpoint lacking `missing` (sorted, not empty) is told."""
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (f"{checkpoint_in(model_dir)} has no tensor {missing[0]}{more}, which the model needs: transformers would "
            "fill it with random values; the download or save is incomplete: fetch it again")


def mismatch_line(model_dir: Path, name: str, stored: list[int], wanted: list[int], more: int = 0) -> str:
    """What a checkpoint whose `name` is `stored`, where the config's model has `wanted`, is told."""
    others = f" (and {more} more)" if more else ""
    return (f"{checkpoint_in(model_dir)} holds {name} of shape {stored}{others}, where the model its config.json "
            f"describes has {wanted}: the config and the weights are of different models; fix config.json or the "
            "weights (download or save the folder again)")


def refuse_incomplete(model_dir: Path, model: Any, info: dict[str, Any]) -> None:
    """transformers' loading report (`from_pretrained(..., output_loading_info=True)`) of a whole-model load, held to
    the checkpoint: a missing, unexpected or mismatched tensor is one line naming it (InputError)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise InputError(missing_line(model_dir, missing))
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, stored, wanted = mismatched[0]
        raise InputError(mismatch_line(model_dir, name, list(stored), list(wanted), len(mismatched) - 1))
    from kvforge.models.mtp import mtp_tensor_pattern

    mtp = mtp_tensor_pattern(getattr(model, "config", None))  # the MTP layers go to draft.onnx, not the model
    unexpected = [name for name in info.get("unexpected_keys") or () if mtp is None or not re.search(mtp, name)]
    refuse_unexpected(model_dir, model, sorted(unexpected))


def refuse_doubled_layers(model_dir: Path, prefixes: Iterable[str], names: Container[str]) -> None:
    """A pre-quantised checkpoint that holds a layer both as integers (its `prefixes`) and as a float `.weight`
    is refused in one line naming the layer: its dequantised twin would hold that weight twice."""
    doubled = sorted(prefix for prefix in prefixes if f"{prefix}.weight" in names)
    if doubled:
        more = f" (and {len(doubled) - 1} more layers)" if len(doubled) > 1 else ""
        raise InputError(
            f"the checkpoint in {model_dir} holds the layer {doubled[0]}{more} twice, as quantised integers and as "
            f"{doubled[0]}.weight: a layer is stored one way; remove the stale tensor (or save the checkpoint again)")
