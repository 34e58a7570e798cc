"""Prefill calls never split an image block (Gemma 3: an image's tokens attend to each other both ways, and the
prefill graph sees a block only within one call; exporter/image_blocks.py). Where a prompt is cut (the scheduler's
chunked prefill, a reused prefix's end), the cut moves to a block's edge. Exports whose vision record has no
`image_blocks` are cut as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def block_token(export: Any) -> int | None:
    """The image token id whose runs are blocks to keep whole in this export, None where there are none."""
    images = getattr(export, "images", None)
    vision = getattr(images, "vision", None) or {}
    return vision["image_token_id"] if vision.get("image_blocks") else None


def chunk_end(ids: Sequence[int], start: int, end: int, token: int | None) -> int:
    """The end of a prefill call over ids[start:end] that keeps every run of `token` whole: back to the start of a
    run that `end` would split, or (a run that began at `start`, longer than the call) on to the run's end."""
    if token is None or end >= len(ids) or end <= start or ids[end] != token or ids[end - 1] != token:
        return end
    run = end - 1
    while run > start and ids[run - 1] == token:
        run -= 1
    if run > start:
        return run
    while end < len(ids) and ids[end] == token:
        end += 1
    return end


def prefix_end(ids: Sequence[int], cached: int, token: int | None) -> int:
    """A reused prefix's length, moved back to the start of the run of `token` it would end inside (the rest of the
    run is prefilled again with its block)."""
    while token is not None and 0 < cached < len(ids) and ids[cached] == token and ids[cached - 1] == token:
        cached -= 1
    return cached
