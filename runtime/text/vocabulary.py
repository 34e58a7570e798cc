"""The export's tokens as the pieces that need them see them (grammars, rows, prompts): its tokenizer,
vocabulary size, pad and end-of-sequence ids. The Generator owns one and hands it on, so those pieces
never need the Generator itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvforge.runtime.text.tokenizer import Tokenizer


@dataclass(frozen=True, eq=False)  # identity: a grammar compiler is kept per vocabulary (weakly)
class Vocabulary:
    folder: Path
    tokenizer: Tokenizer | None
    vocab_size: int
    pad_token_id: int
    eos_token_ids: frozenset[int]
