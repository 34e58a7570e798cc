"""Whisper's timestamp rules (transformers' WhisperTimeStampLogitsProcessor, in numpy) and the segments they give.

A timestamp token <|t|> (t in 0.02 s steps, ids from <|notimestamps|> + 1 on) opens or closes a segment; the rules
make them come in pairs (a text token after a closing pair, a timestamp or the end token after an opening one), never
go back in time, start the text with a timestamp no later than `max_initial` steps, and pick a timestamp whenever the
timestamps together are more likely than the likeliest text token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TIME_STEP = 0.02  # seconds per timestamp token


@dataclass(frozen=True)
class TimestampRules:
    no_timestamps: int  # <|notimestamps|>: the timestamps are the ids after it
    eos: int
    begin: int  # the decoder prompt's length: what a row generated starts there
    max_initial: int | None = None

    @property
    def first(self) -> int:
        return self.no_timestamps + 1

    def apply(self, logits: np.ndarray, step: int, history: Sequence[Sequence[int]]) -> np.ndarray:
        """`logits` [B, V] (already a copy the caller owns) with the rules applied, in place."""
        lowest, first = np.finfo(logits.dtype).min, self.first
        logits[:, self.no_timestamps] = lowest
        for row, tokens in enumerate(history):
            seq = list(tokens[self.begin:])
            last = len(seq) >= 1 and seq[-1] >= first
            penultimate = len(seq) < 2 or seq[-2] >= first
            if last:
                if penultimate:  # a closing pair: text next
                    logits[row, first:] = lowest
                else:  # an opening timestamp: no text token before its closing one (or the end)
                    logits[row, : self.eos] = lowest
            stamps = [token for token in seq if token >= first]
            floor = first
            if stamps:  # never back in time; a closed segment's end is not repeated
                floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
            logits[row, first:floor] = lowest
        if step == 0:  # the text starts with a timestamp, early enough
            logits[:, :first] = lowest
            if self.max_initial is not None:
                logits[:, first + self.max_initial + 1:] = lowest
        scores = logits.astype(np.float64)
        logprobs = scores - _logsumexp(scores)
        stamp = _logsumexp(logprobs[:, first:])[:, 0] > logprobs[:, :first].max(axis=-1)
        logits[stamp, :first] = lowest
        return logits


def _logsumexp(values: np.ndarray) -> np.ndarray:
    top = values.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(values - top).sum(axis=-1, keepdims=True))


def segments(tokens: Sequence[int], first: int, offset: float, eos: int, decode: Any) -> list[dict[str, Any]]:
    """The timed segments of one window's tokens: each <|a|> text <|b|> run as {"start", "end", "text", "tokens"},
    in seconds from the audio's start (`offset`: the window's); text after an unclosed timestamp (or none) is a last
    segment ending where the window's timestamps end. `decode(ids) -> str`."""
    found: list[dict[str, Any]] = []
    start, text = None, []
    for token in tokens:
        if token == eos:
            break
        if token < first:
            text.append(token)
            continue
        time = offset + (token - first) * TIME_STEP
        if start is None:
            start = time
        else:
            found.append({"start": round(start, 2), "end": round(time, 2), "text": decode(text).strip(), "tokens": text})
            start, text = None, []
    if text:
        begin = start if start is not None else (found[-1]["end"] if found else offset)
        found.append({"start": round(begin, 2), "end": round(begin, 2), "text": decode(text).strip(), "tokens": text})
    return found
