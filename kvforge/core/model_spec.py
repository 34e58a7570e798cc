"""The manifest's `model` section (ModelSpec): what the runtime needs to know about the model besides its KV
layout, each field checked on load so that a crafted manifest fails in one line naming it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvforge.core.errors import ManifestError

MAX_VOCAB_SIZE = 1 << 24  # 16.7M: far beyond real vocabularies (~260k), far below a crafted 1e12
MAX_CONTEXT = 1 << 24  # 16.7M positions: beyond the longest contexts (10M), far below a crafted 1e15


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to know about the model besides its KV layout (manifest `model`)."""

    vocab_size: int
    num_heads: int
    hidden_size: int | None = None
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None
    source: str | None = None
    architecture: str | None = None
    model_type: str | None = None

    def to_manifest(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_id"] = list(self.eos_token_id)
        return out

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> ModelSpec:
        model = manifest.get("model")
        if not isinstance(model, Mapping):
            raise ManifestError("the manifest's 'model' must be an object; re-run the export")
        for name in ("vocab_size", "num_heads"):
            value = model.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ManifestError(f"model.{name} must be a positive integer, got {value!r}; re-run the export")
        if model["vocab_size"] > MAX_VOCAB_SIZE:  # buffers are sized from it: refuse before allocating
            raise ManifestError(
                f"model.vocab_size {model['vocab_size']} is beyond any real vocabulary (at most {MAX_VOCAB_SIZE}); "
                "the manifest was crafted or corrupted: re-run the export"
            )
        # Each field's type is checked here, so a crafted value fails in one line naming it, not
        # deep in the runtime (int("x") of a pad id, a list where a count goes).
        _check_optional_int(model, "hidden_size", minimum=1)
        _check_optional_int(model, "max_position_embeddings", minimum=1, maximum=MAX_CONTEXT)
        _check_optional_int(model, "sliding_window", minimum=0)
        check_token_ids(model, "model", model["vocab_size"])
        eos = model.get("eos_token_id")
        for name in ("source", "architecture", "model_type"):
            if model.get(name) is not None and not isinstance(model[name], str):
                raise ManifestError(f"model.{name} must be a string or null, got {model[name]!r}; re-run the export")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in model.items() if k in known}
        values["eos_token_id"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(**values)


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_optional_int(section: Mapping[str, Any], name: str, minimum: int | None = None,
                        maximum: int | None = None) -> None:
    """ManifestError unless model.`name` is absent, null or an integer (>= `minimum`, <= `maximum`)."""
    value = section.get(name)
    if value is None:
        return
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        wanted = "an integer" if minimum is None else f"an integer >= {minimum}"
        wanted += f" and <= {maximum}" if maximum is not None else ""
        raise ManifestError(f"model.{name} must be {wanted} or null, got {value!r}; re-run the export")


def check_token_ids(section: Mapping[str, Any], where: str, vocab_size: int) -> None:
    """ManifestError unless `section`'s eos_token_id (an id or a list), bos_token_id and pad_token_id
    are ids of the vocabulary (or null; bos and pad may be -1, Hugging Face's "none"): a crafted id
    (an eos of 1e12 that can never stop a generation, a pad of -5 that indexes from the end) fails here,
    naming the field."""
    def valid(value: Any, none_allowed: bool) -> bool:
        return is_int(value) and (0 <= value < vocab_size or (none_allowed and value == -1))

    for name in ("bos_token_id", "pad_token_id"):
        value = section.get(name)
        if value is not None and not valid(value, True):
            raise ManifestError(f"{where}.{name} must be a token id below vocab_size {vocab_size} (or -1 or null), "
                                f"got {value!r}; re-run the export")
    eos = section.get("eos_token_id")
    if not (eos is None or valid(eos, False) or (isinstance(eos, list) and all(valid(e, False) for e in eos))):
        raise ManifestError(f"{where}.eos_token_id must be a token id below vocab_size {vocab_size}, a list of them or "
                            f"null, got {eos!r}; re-run the export")
