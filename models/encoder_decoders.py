"""The encoder-decoder families kvforge exports: `encoder.onnx` beside the decoder's prefill and decode graphs
(kvforge/core/encoder_contract.py).

A row per model type: what its encoder takes (token ids, or Whisper's log-mel features), which transformers Auto
class loads it, and where its stacks keep their attention modules. BART, mBART, Marian, Pegasus and Whisper share
transformers' layout (`model.model.encoder.layers[i].self_attn`, `model.model.decoder.layers[i].self_attn` /
`encoder_attn` with k_proj / v_proj, a positions table `decoder.embed_positions`); T5 and mT5, laid out otherwise and
with a relative position bias for positions, give their own functions (T5Family).
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


# -- T5, Flan-T5, mT5: blocks of layers, a relative position bias instead of a positions table --------------------

T5_LENGTH = 512  # the released configs' n_positions: what T5 was trained on (its relative bias has no hard limit)


def t5_roles(model: Any) -> dict[int, tuple[str, int]]:
    """T5's attention modules: block[i].layer[0].SelfAttention in both stacks, block[i].layer[1].EncDecAttention."""
    encoder, decoder = _stacks(model)
    roles = {id(block.layer[0].SelfAttention): ("encoder", index) for index, block in enumerate(encoder.block)}
    for index, block in enumerate(decoder.block):
        roles[id(block.layer[0].SelfAttention)] = ("self", index)
        roles[id(block.layer[1].EncDecAttention)] = ("cross", index)
    return roles


def t5_cross(model: Any) -> list[tuple[Any, Any]]:
    return [(block.layer[1].EncDecAttention.k, block.layer[1].EncDecAttention.v) for block in model.get_decoder().block]


def t5_logits(model: Any, hidden: Any) -> Any:
    """T5 scales the decoder's output by d_model^-0.5 before its head where the config says (tied embeddings)."""
    if getattr(model.config, "scale_decoder_outputs", False):
        hidden = hidden * (model.config.d_model ** -0.5)
    return model.get_output_embeddings()(hidden)


def t5_self_bias(model: Any, rows: Any, capacity: Any) -> Any:
    """The decoder's relative position bias [B, H, S, capacity] of query positions `rows` [B, S] over cache positions
    0 .. capacity-1: its first block's table at the bucket of (key - query), HF's own bucketing (one direction)."""
    import torch

    attention = model.get_decoder().block[0].layer[0].SelfAttention
    relative = torch.arange(capacity, dtype=torch.int64)[None, None, :] - rows[:, :, None]
    buckets = attention._relative_position_bucket(relative, bidirectional=False,
                                                  num_buckets=attention.relative_attention_num_buckets,
                                                  max_distance=attention.relative_attention_max_distance)
    return attention.relative_attention_bias(buckets).permute(0, 3, 1, 2)  # [B, S, C, H] -> [B, H, S, C]


@dataclass(frozen=True)
class EncoderDecoderFamily:
    """What exporting one encoder-decoder type needs. `input`: "ids" or "features"; `auto`: the transformers Auto
    class that loads it; `roles`, `cross`, `logits`, `positions`: where its attention modules, cross projections,
    LM head and decoder positions are (the shared layout's functions above by default; `positions` None: no table);
    `self_bias`: the decoder's self-attention bias over the cache (T5), or None."""

    model_type: str
    input: str
    auto: str = "AutoModelForSeq2SeqLM"
    roles: Any = attention_roles
    cross: Any = cross_projections
    logits: Any = output_logits
    positions: Any = decoder_positions
    self_bias: Any = None
    fp16: bool = True  # False: its fp16 layers clamp overflow behind a data-dependent test (torch.export refuses it)
    note: str = ""

    def heads(self, config: Any) -> tuple[int, int]:
        """The decoder's attention heads and head size (its self cache and the cross keys are laid out so)."""
        heads = config.decoder_attention_heads
        return heads, config.d_model // heads

    def encoder_layers(self, config: Any) -> int:
        return config.encoder_layers

    def decoder_layers(self, config: Any) -> int:
        return config.decoder_layers

    def max_source(self, config: Any) -> int:
        """The encoder's length limit (Whisper: its window's positions)."""
        return config.max_source_positions if self.input == "features" else config.max_position_embeddings

    def max_target(self, config: Any) -> int:
        """The decoder's position limit."""
        return getattr(config, "max_target_positions", None) or config.max_position_embeddings

    def start_token(self, model: Any) -> int:
        """The token decoding starts from, where transformers' `generate` looks: the decoder start token of the config
        or of the generation config, else the begin token (T5's configs name none: its pad token, as it trains)."""
        for source in (model.config, model.generation_config):
            if getattr(source, "decoder_start_token_id", None) is not None:
                return int(source.decoder_start_token_id)
        for source in (model.generation_config, model.config):
            if getattr(source, "bos_token_id", None) is not None:
                return int(source.bos_token_id)
        return int(model.config.pad_token_id)


@dataclass(frozen=True)
class T5Family(EncoderDecoderFamily):
    """T5's layout and config names: heads of d_kv (not d_model / heads), num_layers / num_decoder_layers."""

    roles: Any = t5_roles
    cross: Any = t5_cross
    logits: Any = t5_logits
    positions: Any = None
    self_bias: Any = t5_self_bias

    def heads(self, config: Any) -> tuple[int, int]:
        return config.num_heads, config.d_kv

    def encoder_layers(self, config: Any) -> int:
        return config.num_layers

    def decoder_layers(self, config: Any) -> int:
        return config.num_decoder_layers

    def max_source(self, config: Any) -> int:
        return int(getattr(config, "n_positions", None) or T5_LENGTH)

    def max_target(self, config: Any) -> int:
        return self.max_source(config)


ENCODER_DECODERS: dict[str, EncoderDecoderFamily] = {
    family.model_type: family for family in (
        EncoderDecoderFamily("bart", "ids", fp16=False, note="BART (summarisation, generation)"),
        EncoderDecoderFamily("mbart", "ids", note="mBART (translation; the target language's token starts decoding)"),
        EncoderDecoderFamily("marian", "ids", fp16=False, note="Marian / OPUS-MT (translation)"),
        EncoderDecoderFamily("pegasus", "ids", note="Pegasus (summarisation)"),
        EncoderDecoderFamily("m2m_100", "ids", positions=m2m100_positions,
                             note="M2M100 and NLLB (translation; the target language's token is forced first)"),
        EncoderDecoderFamily("blenderbot", "ids", note="Blenderbot (dialogue)"),
        EncoderDecoderFamily("blenderbot-small", "ids", fp16=False, note="Blenderbot small (dialogue)"),
        EncoderDecoderFamily("plbart", "ids", fp16=False, note="PLBart (code and text)"),
        EncoderDecoderFamily("whisper", "features", auto="AutoModelForSpeechSeq2Seq",
                             note="Whisper (speech recognition and translation)"),
        T5Family("t5", "ids", note="T5 and Flan-T5 (text to text; relative position bias)"),
        T5Family("mt5", "ids", note="mT5 (multilingual T5)"),
    )
}


def encoder_decoder_family(model_type: Any) -> EncoderDecoderFamily | None:
    return ENCODER_DECODERS.get(model_type) if isinstance(model_type, str) else None
