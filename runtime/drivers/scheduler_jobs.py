"""The Scheduler's record of one request (runtime/drivers/scheduler.py): its handle, prompt, choices and
speculation, and how far its prefill has come."""

from __future__ import annotations

import time

import numpy as np

from kvforge.runtime.drivers.handles import RequestHandle
from kvforge.runtime.drivers.images import Images, RowImages
from kvforge.runtime.drivers.proposers import Proposer
from kvforge.runtime.drivers.rows import Picker, Row
from kvforge.runtime.drivers.scheduler_speculation import RowSpeculation


class Job:
    """A request being prefilled or decoded: its handle, prompt and choices (one Row each, on the engine
    once prefilled), and how much of its prompt is in the staging cache."""

    def __init__(self, handle: RequestHandle, prompt_ids: list[int], rows: list[Row], pickers: list[Picker],
                 images: RowImages | None = None, key: list[int] | None = None, proposer: Proposer | None = None,
                 speculation: list[RowSpeculation | None] | None = None) -> None:
        self.handle = handle
        self.request = handle.request
        self.prompt_ids = prompt_ids
        self.images = images  # a vision-language export's prompt images (their features, by image token)
        self.key = key if key is not None else prompt_ids  # the prefix store's key: image tokens keyed by image
        self.rows = rows
        self.pickers = pickers
        for row in rows:
            row.owner = self
        self.proposer = proposer  # its rows' proposer (None: they do not speculate)
        self.speculation = speculation or [None] * len(rows)  # by choice: draft length, adapted
        self.hidden: list[np.ndarray] = []  # the target's hidden states of each prefill chunk (a head reads them)
        self.prefilled = 0  # prompt positions in the staging cache
        self.cached = 0
        self.started = time.perf_counter()
        self.ttft_ms: float | None = None

    @property
    def needs_hidden(self) -> bool:
        """Whether its proposer reads the target's hidden states (a head): of every prompt position."""
        return self.proposer is not None and self.proposer.needs_hidden

    def chunk_images(self, images: Images, length: int) -> np.ndarray | None:
        """The image features of the chunk of `length` tokens from `prefilled`: those of the image tokens in it (the
        cached or earlier chunks' skipped), or None."""
        if self.images is None:
            return None
        token = images.vision["image_token_id"]
        before = self.prompt_ids[:self.prefilled].count(token)
        inside = self.prompt_ids[self.prefilled:self.prefilled + length].count(token)
        return self.images.features[before:before + inside] if inside else None

    def chunk_positions(self, length: int) -> np.ndarray | None:
        """An M-RoPE prompt's positions [3, 1, length] of the chunk from `prefilled`, or None."""
        if self.images is None or self.images.positions is None:
            return None
        return self.images.positions[:, None, self.prefilled:self.prefilled + length]
