"""A tokenizer built locally (no hub): byte-level BPE trained on a small built-in corpus.

Deterministic for a given vocabulary size, so test folders and the demo are reproducible.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the
tokens before it. Attention lets every token look back at the cache of keys and values written by
earlier tokens. Prefill reads the whole prompt at once; decode adds one token per step. Once upon a
time there was a small model with random weights, and it said whatever its weights made likely.
kvforge exports a prefill graph and a decode graph, fuses attention into one node per layer and
binds the KV cache in place so that nothing is copied between steps. Numbers: 0 1 2 3 4 5 6 7 8 9.
Hello, world! How are you today? I am fine, thank you. def main(): return 42
"""


def build_tokenizer(vocab_size: int = 512, specials: tuple[str, ...] | None = None) -> Tokenizer:
    """Byte-level BPE with <s> prepended to every encoding (as Llama-style tokenizers do). `specials=()`: no special
    tokens and nothing prepended (a tokenizer whose special tokens the caller adds after the text ones: Whisper's)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS if specials is None else list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if specials is None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    return tokenizer
