"""The export folder's tokenizer, read from `tokenizer.json` with the `tokenizers` library (no transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from kvforge.core.errors import InputError, ManifestError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """encode/decode plus incremental detokenizers for streaming."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ManifestError(
                f"{path} does not exist: the export folder has no tokenizer; pass token ids instead of text"
            )
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise ManifestError(f"{path} is not a readable tokenizers file ({err}); re-run the export") from err
        self._specials: tuple[str, ...] | None = None
        self._plain: HFTokenizer | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens (BOS) are added by the tokenizer's own post-processor,
        as Hugging Face does with add_special_tokens=True (a rendered chat template has its own)."""
        if not isinstance(text, str):
            raise InputError(f"a text prompt must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # lone surrogates (undecodable bytes): tokenizers raises a TypeError
            raise InputError(
                f"the text is not valid UTF-8 (undecodable bytes at character {err.start}); pass UTF-8 text"
            ) from None
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (`<|im_end|>`, `</s>`, ...), longest first."""
        if self._specials is None:
            texts = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content}
            self._specials = tuple(sorted(texts, key=len, reverse=True))
        return self._specials

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids for `text` with special-token text in it taken as plain text ("<|im_end|>" as
        "<", "|", "im", ...), never as the control token. A second tokenizer holds that setting, so
        that encode() running in other threads never sees it."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        self.encode(text, add_special_tokens=False)  # the same checks (str, UTF-8)
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    @property
    def longest_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary (added tokens included): no text of
        more than this many characters per token can fit a given number of tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for llguidance's token masks, runtime/controls/constraint.py)."""
        return self._tok.to_str()

    def incremental(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never need to be taken back.

    `tokenizers`' DecodeStream does the work (it holds back incomplete UTF-8 sequences and keeps
    the decoder's spacing); `flush` returns whatever it still holds at the end of a generation.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the full decode already returned

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly stable text (possibly "")."""
        self._ids.append(int(token_id))
        chunk = self._stream.step(self._tokenizer._tok, int(token_id))
        if not chunk:
            return ""
        self._emitted += len(chunk)
        return chunk

    def flush(self) -> str:
        """Text held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        full = self._tokenizer.decode(self._ids, self._skip)
        tail = full[self._emitted :]
        self._emitted = len(full)
        return tail


class TokenPieces:
    """Each token id's text and UTF-8 bytes (what OpenAI's `token` and `bytes` hold). Byte-level BPE
    vocabularies store bytes as characters (GPT-2's table), which are mapped back; a token that is
    only part of a character shows as "bytes:\\xe2\\x80" (OpenAI's form). Without a tokenizer a
    token shows as "token_id:ID" (vLLM's form)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        if tokenizer is None:
            return
        self._tok = tokenizer._tok
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._byte_level = _has_byte_level_decoder(json.loads(self._tok.to_str()).get("decoder"))
        self._chars = {c: b for b, c in _gpt2_byte_chars().items()}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        piece = self._cache.get(token)
        if piece is None:
            piece = self._cache[token] = self._piece(token)
        return piece

    def offsets(self, ids: list[int]) -> list[int]:
        """Character offset of each token of `ids` in their decoded text, special tokens (BOS)
        taking none, as in the echoed prompt (a token held back, part of a character, starts where
        the character does)."""
        if self.tokenizer is None:
            return [0] * len(ids)
        detok, offsets, at = self.tokenizer.incremental(), [], 0
        for token in ids:
            offsets.append(at)
            at += len(detok.add(token))
        return offsets

    def _piece(self, token: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token}", []
        raw = self._tok.id_to_token(token) or ""
        if token in self._added:
            data = self._added[token].encode("utf-8")
        elif self._byte_level and all(c in self._chars for c in raw):
            data = bytes(self._chars[c] for c in raw)
        elif raw.startswith("<0x") and raw.endswith(">") and len(raw) == 6:  # SentencePiece byte fallback
            data = bytes([int(raw[3:5], 16)])
        else:
            data = self._tok.decode([token], skip_special_tokens=False).encode("utf-8")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return text, list(data)


def _has_byte_level_decoder(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    return decoder.get("type") == "ByteLevel" or any(_has_byte_level_decoder(d) for d in decoder.get("decoders") or [])


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table (byte-level BPE vocabularies spell bytes with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
