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


def long_form_segments(seq: Sequence[int], first: int, offset: float, window_frames: int, stride: int,
                       decode: Any) -> tuple[list[dict[str, Any]], int]:
    """One long-form window's segments and how many feature frames the next window starts after, as transformers'
    Whisper `generate` cuts them (its `_retrieve_segment`). `seq`: the window's tokens after the prompt, its end token
    dropped; `offset`: the window's start in seconds; `window_frames`: the frames it held (3000, fewer at the end);
    `stride`: feature frames per timestamp step (2).

    Each pair of adjacent timestamps closes a segment. A window whose last segment ends with a lone timestamp ("no
    speech after it") is consumed whole; otherwise the text after the last pair is dropped and the next window starts
    at that pair's time, so a word cut by the window's end is decoded again whole. A window with no pair is one
    segment ending at its last timestamp (or the window's end)."""
    stamps = [token >= first for token in seq]
    single_ending = stamps[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(stamps) - 1) if stamps[i] and stamps[i + 1]]

    def segment(tokens: Sequence[int], start: float, end: float) -> dict[str, Any]:
        text = [token for token in tokens if token < first]
        return {"start": round(start, 2), "end": round(end, 2), "text": decode(text).strip(), "tokens": text}

    if not cuts:
        last = [token for token in seq if token >= first]
        end_step = last[-1] - first if last and last[-1] != first else window_frames // stride
        return [segment(seq, offset, offset + end_step * TIME_STEP)], window_frames
    cuts = [*cuts, len(seq)] if single_ending else [*cuts[:-1], cuts[-1] + 1]
    found, begin = [], 0
    for index, cut in enumerate(cuts):
        tokens = seq[begin:cut]
        closing = tokens[-1] if index < len(cuts) - 1 or single_ending else tokens[-2]
        found.append(segment(tokens, offset + (tokens[0] - first) * TIME_STEP, offset + (closing - first) * TIME_STEP))
        begin = cut
    advance = window_frames if single_ending else (seq[begin - 2] - first) * stride
    return found, advance
