"""Prompts in, token-id rows out: the forms a prompt may take and their validation, in one place
(the Generator and the Scheduler both parse prompts here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.text.tokenizer import TOKENIZER_FILE, Tokenizer


class RenderedChat:
    """A conversation already rendered to token ids: generated as text (decoded, streamed)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __repr__(self) -> str:
        return f"RenderedChat({len(self.ids)} tokens)"


# One text, a batch of texts, one prompt of token ids, a batch of token-id rows, or a rendered chat.
Prompts = str | list[str] | list[int] | list[list[int]] | RenderedChat


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def as_id_list(value: Any, what: str = "token id") -> list[int]:
    """None, one id, or a collection of ids -> list of ids."""
    if value is None:
        return []
    values = [value] if is_int(value) else value
    if not isinstance(values, (list, tuple, set, frozenset)) or not all(is_int(v) for v in values):
        raise InputError(f"{what} must be an integer or a list of integers, got {value!r}")
    return [int(v) for v in values]


def parse_prompts(prompts: Prompts, tokenizer: Tokenizer | None, vocab_size: int,
                  folder: str | Path) -> tuple[list[list[int]], bool]:
    """Token id rows for the prompts, and whether they came as text (then the output is decoded)."""
    if isinstance(prompts, RenderedChat):
        if len(prompts.ids) == 0:
            # A template that renders these messages to "" would reach the graph with no positions.
            raise InputError(
                "the prompt is empty: the chat template rendered these messages to no text (no tokens); "
                "check the messages, or the export's chat template"
            )
        return _checked_rows([list(prompts.ids)], vocab_size), True
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    if isinstance(prompts, (bytes, bytearray)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"prompts must be a str, a list of str, or a list of token-id lists, got "
                         f"{type(prompts).__name__} {prompts!r}"[:300])
    if len(prompts) == 0:
        raise InputError("no prompts given (the prompt is empty): pass a str, a list of str, or a list of "
                         "token-id lists")
    for i, p in enumerate(prompts):
        if isinstance(p, (bytes, bytearray)):
            raise InputError(f"prompt {i} is bytes; pass text as str (decode it from UTF-8 first)")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise InputError(f"{folder} has no {TOKENIZER_FILE}, so prompts must be token ids, not text")
        rows = []
        for i, text in enumerate(prompts):
            if text == "":
                raise InputError(f"prompt {i} is empty; give at least one character")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:  # lone surrogates: bytes that were not UTF-8
                raise InputError(
                    f"prompt {i} is not valid UTF-8 text (undecodable bytes at character {err.start}); "
                    "pass UTF-8 text"
                ) from err
            rows.append(tokenizer.encode(text))
        text_mode = True
    elif all(is_int(p) for p in prompts):
        rows = [list(prompts)]  # a single prompt given as one list of ids
        text_mode = False
    elif all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
        rows = [list(p.tolist() if isinstance(p, np.ndarray) else p) for p in prompts]
        text_mode = False
    else:
        raise InputError("prompts must be all text (str) or all token-id lists, not a mix")
    return _checked_rows(rows, vocab_size), text_mode


def _checked_rows(rows: list[list[Any]], vocab_size: int) -> list[list[int]]:
    """The rows as ints, or InputError naming the first empty row or id outside the vocabulary."""
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise InputError(f"prompt {i} has no tokens; give at least one token id")
        for pos, token in enumerate(row):
            if not is_int(token):
                raise InputError(f"prompt {i} position {pos} holds {token!r}, not an integer token id")
            if not 0 <= int(token) < vocab_size:
                raise InputError(
                    f"prompt {i} position {pos} has token id {int(token)}, outside the vocabulary [0, {vocab_size})"
                )
    return [[int(t) for t in row] for row in rows]
