"""The encoder-decoder families kvforge exports: `encoder.onnx` beside the decoder's prefill and decode graphs
(kvforge/core/encoder_contract.py).

A row per model type: what its encoder takes (token ids, or Whisper's log-mel features), which transformers Auto
class loads it, and where its stacks keep their attention modules. BART, mBART, Marian, Pegasus and Whisper share
transformers' layout (`model.model.encoder.layers[i].self_attn`, `model.model.decoder.layers[i].self_attn` /
`encoder_attn` with k_proj / v_proj, a positions table `decoder.embed_positions`); a family laid out otherwise (T5)
gives its own functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("encoder", "self", "cross")  # an attention module's part: the encoder's own, the decoder's self / cross


def _stacks(model: Any) -> tuple[Any, Any]:
    return model.get_encoder(), model.get_decoder()


def attention_roles(model: Any) -> dict[int, tuple[str, int]]:
    """id(module) -> (role, layer) for every attention module of the shared layout."""
    encoder, decoder = _stacks(model)
    roles = {id(layer.self_attn): ("encoder", index) for index, layer in enumerate(encoder.layers)}
    for index, layer in enumerate(decoder.layers):
        roles[id(layer.self_attn)] = ("self", index)
        roles[id(layer.encoder_attn)] = ("cross", index)
    return roles


def cross_projections(model: Any) -> list[tuple[Any, Any]]:
    """Each decoder layer's cross-attention key and value projections, which the encoder graph applies once."""
    return [(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in model.get_decoder().layers]


def output_logits(model: Any, hidden: Any) -> Any:
    """The LM head of the shared layout: BART's family adds `final_logits_bias`; Whisper's head is `proj_out`."""
    logits = model.get_output_embeddings()(hidden)
    bias = getattr(model, "final_logits_bias", None)
    return logits + bias.to(logits.dtype) if bias is not None else logits


def decoder_positions(model: Any, rows: Any) -> Any:
    """The decoder's position embeddings [B, S, hidden] at per-row positions `rows` [B, S] (past_lens[b] + t): its
    table `embed_positions.weight` (learned or sinusoidal), shifted by the module's `offset` (BART's 2)."""
    table = model.get_decoder().embed_positions
    return table.weight[rows + getattr(table, "offset", 0)]


def m2m100_positions(model: Any, rows: Any) -> Any:
    """M2M100's (NLLB's) sinusoidal table counts positions from its padding index (a decoder never reads padding)."""
    table = model.get_decoder().embed_positions
    return table.weights[rows + table.padding_idx + 1].to(table.weights.dtype)


@dataclass(frozen=True)
class EncoderDecoderFamily:
    """What exporting one encoder-decoder type needs. `input`: "ids" or "features"; `auto`: the transformers Auto
    class that loads it; `roles`, `cross`, `logits`, `positions`: where its attention modules, cross projections,
    LM head and decoder positions are (the shared layout's functions above by default)."""

    model_type: str
    input: str
    auto: str = "AutoModelForSeq2SeqLM"
    roles: Any = attention_roles
    cross: Any = cross_projections
    logits: Any = output_logits
    positions: Any = decoder_positions
    note: str = ""

    def heads(self, config: Any) -> tuple[int, int]:
        """The decoder's attention heads and head size (its self cache and the cross keys are laid out so)."""
        heads = config.decoder_attention_heads
        return heads, config.d_model // heads

    def decoder_layers(self, config: Any) -> int:
        return config.decoder_layers

    def max_target(self, config: Any) -> int:
        """The decoder's position limit."""
        return getattr(config, "max_target_positions", None) or config.max_position_embeddings


ENCODER_DECODERS: dict[str, EncoderDecoderFamily] = {
    family.model_type: family for family in (
        EncoderDecoderFamily("bart", "ids", note="BART (summarisation, generation)"),
        EncoderDecoderFamily("mbart", "ids", note="mBART (translation; the target language's token starts decoding)"),
        EncoderDecoderFamily("marian", "ids", note="Marian / OPUS-MT (translation)"),
        EncoderDecoderFamily("pegasus", "ids", note="Pegasus (summarisation)"),
        EncoderDecoderFamily("m2m_100", "ids", positions=m2m100_positions,
                             note="M2M100 and NLLB (translation; the target language's token is forced first)"),
        EncoderDecoderFamily("whisper", "features", auto="AutoModelForSpeechSeq2Seq",
                             note="Whisper (speech recognition and translation)"),
    )
}


def encoder_decoder_family(model_type: Any) -> EncoderDecoderFamily | None:
    return ENCODER_DECODERS.get(model_type) if isinstance(model_type, str) else None
