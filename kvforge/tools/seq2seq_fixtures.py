"""Tiny seeded encoder-decoder checkpoints for tests and examples: each family's released config with its sizes shrunk
(its activation, norms, embedding scale, position kind and special ids kept, remapped into a 96-token vocabulary).
The weights are random: the text is noise; they exist so the export can be checked against transformers without a hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 96
# Whisper's fixtures: Whisper's id layout with a shrunk text vocabulary (256 bytes + merges), then its special tokens
# in its order: <|endoftext|>, <|startoftranscript|>, the languages, the tasks, ..., <|notimestamps|>, and the 1501
# timestamps <|0.00|> ... <|30.00|>.
WHISPER_TEXT = 300
WHISPER_LANGUAGES = ("en", "de", "fr")
WHISPER_SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in WHISPER_LANGUAGES),
                    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                    "<|notimestamps|>")
WHISPER_VOCAB = WHISPER_TEXT + len(WHISPER_SPECIALS) + 1501
_EOT, _SOT = WHISPER_TEXT, WHISPER_TEXT + 1
_SIZES = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0,
              activation_dropout=0.0, init_std=0.2)
# T5's names for its sizes; heads of d_kv, whose product need not be d_model (Flan-T5-small: 6 x 64 against 512).
_T5_SIZES = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
                 dropout_rate=0.0)
_T5_IDS = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

# The released configs' settings that shape the computation (sizes aside), by fixture name.
FIXTURES: dict[str, dict[str, Any]] = {
    # facebook/bart-large-cnn: post-norm, learned positions (offset 2), embedding layernorm, GELU
    "bart": dict(model_type="bart", activation_function="gelu", scale_embedding=False, max_position_embeddings=64,
                 pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
                 forced_eos_token_id=2),
    # facebook/mbart-large-50: pre-norm with final layernorms, scaled embeddings
    "mbart": dict(model_type="mbart", activation_function="gelu", scale_embedding=True, max_position_embeddings=64,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2),
    # Helsinki-NLP/opus-mt-en-de: sinusoidal positions, SiLU, scaled and shared embeddings, pad starts decoding
    "marian": dict(model_type="marian", activation_function="swish", scale_embedding=True, max_position_embeddings=64,
                   static_position_embeddings=True, share_encoder_decoder_embeddings=True, pad_token_id=VOCAB - 1,
                   eos_token_id=0, decoder_start_token_id=VOCAB - 1, forced_eos_token_id=0),
    # google/pegasus-xsum: pre-norm, sinusoidal positions, ReLU
    "pegasus": dict(model_type="pegasus", activation_function="relu", scale_embedding=True, max_position_embeddings=64,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1),
    # facebook/m2m100_418M (and NLLB's dense models): sinusoidal positions from the padding index, ReLU, scaled
    "m2m100": dict(model_type="m2m_100", activation_function="relu", scale_embedding=True, max_position_embeddings=64,
                   init_std=0.5,  # (its scaled embeddings drown 0.2: greedy text would repeat one token)
                   pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
    # facebook/blenderbot-400M-distill, facebook/blenderbot_small-90M, uclanlp/plbart-base: BART's
    # layout with their own norms, positions and ids (transformers' defaults for each are the released base's)
    "blenderbot": dict(model_type="blenderbot", max_position_embeddings=64),
    "blenderbot-small": dict(model_type="blenderbot-small", max_position_embeddings=64),
    "plbart": dict(model_type="plbart", max_position_embeddings=64),
    # google-t5/t5-small: ReLU, tied embeddings (the decoder's output scaled by d_model^-0.5), 32 relative buckets
    # reaching 128 positions (one table per stack, in its first block)
    # (this one with a tokenizer.json: T5_TEXT byte-level tokens, its specials first, "</s>" after every source)
    "t5": dict(model_type="t5", feed_forward_proj="relu", tie_word_embeddings=True, relative_attention_num_buckets=32,
               relative_attention_max_distance=128, vocab_size=300, **_T5_IDS,
               initializer_factor=1.5),  # (at T5's own 1.0 its greedy text repeats one token from the first step)
    # google/flan-t5-small: gated GELU, untied head (no scaling), 6 heads of 64 against d_model 512 (here 3 x 8 : 32)
    "flan-t5": dict(model_type="t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_heads=3,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128, **_T5_IDS),
    # google/mt5-small: gated GELU, 8 layers each side (transformers 5.24's generate cannot run unequal counts: its
    # cache is sized by the encoder's)
    "mt5": dict(model_type="mt5", feed_forward_proj="gated-gelu",
                relative_attention_num_buckets=32, relative_attention_max_distance=128, **_T5_IDS),
    # openai/whisper-tiny: 80 mel bins, learned decoder positions, GELU
    "whisper": dict(model_type="whisper", activation_function="gelu", num_mel_bins=80, max_source_positions=1500,
                    max_target_positions=48, vocab_size=WHISPER_VOCAB, pad_token_id=_EOT, bos_token_id=_EOT,
                    eos_token_id=_EOT, decoder_start_token_id=_SOT),
    # openai/whisper-large-v3: 128 mel bins
    "whisper-large-v3": dict(model_type="whisper", activation_function="gelu", num_mel_bins=128,
                             max_source_positions=1500, max_target_positions=48, vocab_size=WHISPER_VOCAB,
                             pad_token_id=_EOT, bos_token_id=_EOT, eos_token_id=_EOT, decoder_start_token_id=_SOT),
    # openai/whisper-large-v3-turbo: large-v3's encoder (128 mel bins, 32 layers) with 4 decoder layers (here 3 and 1)
    "whisper-large-v3-turbo": dict(model_type="whisper", activation_function="gelu", num_mel_bins=128,
                                   encoder_layers=3, decoder_layers=1, max_source_positions=1500,
                                   max_target_positions=48, vocab_size=WHISPER_VOCAB, pad_token_id=_EOT,
                                   bos_token_id=_EOT, eos_token_id=_EOT, decoder_start_token_id=_SOT),
}


# The released generation configs' rules a greedy decoder reads (lengths shrunk), by fixture name; all ask for beams.
GENERATION: dict[str, dict[str, Any]] = {
    "bart": dict(forced_bos_token_id=0, forced_eos_token_id=2, min_length=6, no_repeat_ngram_size=3, num_beams=4),
    "mbart": dict(forced_eos_token_id=2, num_beams=5),
    "marian": dict(bad_words_ids=[[VOCAB - 1]], forced_eos_token_id=0, num_beams=4),
    "pegasus": dict(forced_eos_token_id=1, num_beams=8),
    "m2m100": dict(forced_bos_token_id=90, num_beams=5),  # the target language's token (the caller's choice)
    "blenderbot": {}, "blenderbot-small": {}, "plbart": {},
    "t5": dict(decoder_start_token_id=0), "flan-t5": dict(decoder_start_token_id=0),
    "mt5": dict(decoder_start_token_id=0),
    "whisper": {},  # whisper_generation(): its task tokens too
    "whisper-large-v3": {}, "whisper-large-v3-turbo": {},
}


def whisper_generation() -> dict[str, Any]:
    """The released Whisper generation config's fields, for the fixture's vocabulary layout."""
    special = {token: WHISPER_TEXT + i for i, token in enumerate(WHISPER_SPECIALS)}
    return dict(suppress_tokens=[1, 2, 7, 11, 64], begin_suppress_tokens=[220, _EOT], is_multilingual=True,
                lang_to_id={f"<|{code}|>": special[f"<|{code}|>"] for code in WHISPER_LANGUAGES},
                task_to_id={"translate": special["<|translate|>"], "transcribe": special["<|transcribe|>"]},
                no_timestamps_token_id=special["<|notimestamps|>"], prev_sot_token_id=special["<|startofprev|>"],
                max_initial_timestamp_index=50, return_timestamps=False)


def whisper_tokenizer() -> Any:
    """A byte-level BPE tokenizer (tokenizers) of WHISPER_TEXT tokens, with Whisper's special and timestamp tokens
    after them, at the ids the fixture's model and generation config use."""
    from tokenizers import AddedToken

    from kvforge.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(WHISPER_TEXT, specials=())
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in (*WHISPER_SPECIALS, *timestamps)])
    assert tokenizer.get_vocab_size() == WHISPER_VOCAB and tokenizer.token_to_id("<|notimestamps|>") == \
        WHISPER_TEXT + len(WHISPER_SPECIALS) - 1
    return tokenizer


T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2


def t5_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (tokenizers) with T5's special tokens at its ids and its post-processor: every
    encoding ends with </s>, as T5's own tokenizer writes a source."""
    from tokenizers import processors

    from kvforge.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(vocab_size, specials=T5_SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    assert [tokenizer.token_to_id(token) for token in T5_SPECIALS] == [0, 1, 2]
    return tokenizer


def build_tiny_seq2seq(name: str, folder: str | Path, seed: int = 0) -> Path:
    """Write fixture `name` (FIXTURES, its generation rules GENERATION) as a Hugging Face folder (config.json,
    model.safetensors, generation_config.json; Whisper's also preprocessor_config.json) at `folder`."""
    import torch
    import transformers

    settings = dict(FIXTURES[name])
    model_type = settings.pop("model_type")
    sizes = _T5_SIZES if model_type in ("t5", "mt5") else _SIZES
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **settings})
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSpeechSeq2Seq if model_type == "whisper" else transformers.AutoModelForSeq2SeqLM
    model = auto.from_config(config).eval()
    folder = Path(folder)
    rules = {**GENERATION[name], **(whisper_generation() if model_type == "whisper" else {})}
    for field, value in rules.items():
        setattr(model.generation_config, field, value)
    # A generation config of its own (as released), not one transformers derives again from config.json at load.
    model.generation_config._from_model_config = False
    model.save_pretrained(folder)
    if model_type == "whisper":
        # The released feature extractor's settings: 30 s windows of 3000 frames, two per encoder position.
        transformers.WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(folder)
        whisper_tokenizer().save(str(folder / "tokenizer.json"))
    if name == "t5":
        t5_tokenizer(config.vocab_size).save(str(folder / "tokenizer.json"))
    return folder
