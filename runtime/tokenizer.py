"""The export folder's tokenizer, read from `tokenizer.json` with the `tokenizers` library (no transformers)."""

from __future__ import annotations

from pathlib import Path

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

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for llguidance's token masks, runtime/constraint.py)."""
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
