"""The encoder-decoder contract: the encoder graph, what the decoder's graphs take from it, and the cross-attention op.

An encoder-decoder export holds three graphs over one weights file:

- `encoder.onnx` runs once per input: token ids and their lengths (T5, BART, Marian) or log-mel features
  (Whisper) in; the encoder's last states and each decoder layer's cross-attention keys and values out,
  [B, H, T, D] (heads first), computed once here so that no decoder step projects them again.
- `prefill.onnx` / `decode.onnx` are the decoder's, with the self-attention cache of the KV contract
  (kvforge/core/contract.py), plus ENCODER_LENS and the cross keys and values as inputs only: the
  runtime binds them once per row, and they are never outputs.

The cross-attention op (CROSS_OP): out = softmax(q K^T * scale + bias + mask) V over the first encoder_lens[b] keys
of row b, no causal mask and no cache of its own. Its inputs and attributes are CROSS_INPUTS (then the optional
CROSS_OPTIONAL_INPUTS) and CROSS_ATTRIBUTES, in this order everywhere (the torch op, its reference, the ONNX node,
the lowerings).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.core.contract import GraphIO, KVLayout, OpIdentity
from kvforge.core.errors import ManifestError

ENCODER = "encoder"  # the graph's name: encoder.onnx
ENCODER_INPUT_IDS = "encoder_input_ids"  # [B, T] int64: the source text's tokens, padded
ENCODER_LENS = "encoder_lens"  # [B] int32: each row's real encoder length (the cross keys beyond it are padding)
INPUT_FEATURES = "input_features"  # [B, mel bins, frames] float: Whisper's log-mel features (runtime/media/log_mel.py)
ENCODER_HIDDEN = "encoder_hidden_states"  # [B, T, hidden]: the encoder's last states
ENCODER_INPUTS = {"ids": (ENCODER_INPUT_IDS, ENCODER_LENS), "features": (INPUT_FEATURES,)}


def cross_key(layer: int) -> str:
    """Decoder layer `layer`'s cross-attention keys [B, H, T, D]: an encoder output, a decoder input."""
    return f"cross_key.{layer}"


def cross_value(layer: int) -> str:
    return f"cross_value.{layer}"


def cross_names(num_layers: int) -> tuple[str, ...]:
    """cross_key.0, cross_value.0, cross_key.1, ...: the order the graphs hold them in."""
    return tuple(name for layer in range(num_layers) for name in (cross_key(layer), cross_value(layer)))


def encoder_io(input_kind: str, num_layers: int) -> GraphIO:
    """The encoder graph's IO: `input_kind` "ids" (token ids and lengths) or "features" (Whisper's log-mel)."""
    if input_kind not in ENCODER_INPUTS:
        raise ValueError(f"unknown encoder input {input_kind!r}; expected one of {tuple(ENCODER_INPUTS)}")
    return GraphIO(ENCODER, ENCODER_INPUTS[input_kind], (ENCODER_HIDDEN, *cross_names(num_layers)))


def decoder_io(phase: str, layout: KVLayout) -> GraphIO:
    """The decoder's prefill / decode IO: the decoder-only graph's, with ENCODER_LENS and the cross keys and values
    after its head inputs and before the self-attention cache."""
    plain = GraphIO.of(phase, layout)
    head = plain.inputs[: len(plain.inputs) - len(layout.cache_inputs())]
    return GraphIO(phase, (*head, ENCODER_LENS, *cross_names(layout.num_layers), *layout.cache_inputs()),
                   plain.outputs)


@dataclass(frozen=True)
class EncoderRecord:
    """The manifest's `encoder` record: what the encoder takes and what the decoder starts from."""

    input: str  # "ids" | "features"
    num_heads: int  # the cross keys' and values' heads and head size: [B, num_heads, T, head_dim]
    head_dim: int
    max_length: int  # the longest encoder input (positions, or Whisper's frames / 2)
    hidden: int
    decoder_start_token_id: int
    features: Mapping[str, Any] | None = None  # Whisper: the feature extractor's settings (log_mel.WhisperFeatures)

    def to_manifest(self) -> dict[str, Any]:
        record = {"input": self.input, "num_heads": self.num_heads, "head_dim": self.head_dim,
                  "max_length": self.max_length, "hidden": self.hidden,
                  "decoder_start_token_id": self.decoder_start_token_id}
        return {**record, **({"features": dict(self.features)} if self.features is not None else {})}

    @classmethod
    def from_manifest(cls, record: Any) -> EncoderRecord:
        """The record as read back, each field checked: a ManifestError names the first that is wrong."""
        if not isinstance(record, Mapping):
            raise ManifestError(f"manifest 'encoder' is {type(record).__name__}, not an object; re-run the export")
        if record.get("input") not in ENCODER_INPUTS:
            raise ManifestError(f"manifest encoder.input is {record.get('input')!r}, not one of "
                                f"{', '.join(ENCODER_INPUTS)}; re-run the export")
        numbers = {}
        for name in ("num_heads", "head_dim", "max_length", "hidden", "decoder_start_token_id"):
            value = record.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if "token" in name else 1):
                raise ManifestError(f"manifest encoder.{name} is {value!r}, not a positive integer; re-run the export")
            numbers[name] = value
        features = record.get("features")
        if record["input"] == "features" and not isinstance(features, Mapping):
            raise ManifestError("manifest encoder.features is missing: a features encoder needs the feature "
                                "extractor's settings; re-run the export")
        return cls(record["input"], features=features, **numbers)


# -- the cross-attention op -----------------------------------------------------------------------
CROSS_OP = OpIdentity(domain="kvforge", op_type="CrossAttention", version=1)
CROSS_INPUTS = ("q", "cross_key", "cross_value", "encoder_lens")  # q [B, S, H*D]; K/V [B, H, T, D]; lens [B] int32
CROSS_OPTIONAL_INPUTS = ("attention_bias",)  # [B or 1, H, S, T] added to the scores (T5's encoder: relative bias)
CROSS_OUTPUTS = ("out",)  # [B, S, H*D]
CROSS_ATTRIBUTES = {"num_heads": int, "scale": float}


def check_encoder_manifest(manifest: Mapping[str, Any], path: Any, layout: KVLayout) -> EncoderRecord:
    """An encoder-decoder manifest's `encoder` record and encoder graph (kvforge/core/manifest.py checks the decoder's
    graphs against decoder_io): a ManifestError names the first thing that is wrong."""
    record = EncoderRecord.from_manifest(manifest["encoder"])
    graph = manifest["graphs"].get(ENCODER)
    if not isinstance(graph, Mapping) or graph.get("file") not in manifest["files"]:
        raise ManifestError(f"{path}: an encoder-decoder export lists no verified {ENCODER!r} graph; re-run the export")

    def names(kind: str) -> list[Any]:
        entries = graph.get(kind)
        return [entry.get("name") for entry in entries if isinstance(entry, Mapping)] if isinstance(entries, list) else []

    encoder_io(record.input, layout.num_layers).check(names("inputs"), names("outputs"), str(path))
    return record


def is_encoder_decoder(export_dir: Path) -> bool:
    """Whether `export_dir`'s manifest has an encoder record (read as JSON; load_manifest checks it after)."""
    try:
        # kvforge.json: core/manifest.py's MANIFEST_NAME (that module imports this one)
        return json.loads((Path(export_dir) / "kvforge.json").read_text()).get("encoder") is not None
    except (OSError, ValueError, AttributeError):
        return False  # the decoder-only path says what is wrong with the folder
