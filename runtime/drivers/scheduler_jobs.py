"""The Scheduler's record of one request (runtime/drivers/scheduler.py): its handle, prompt, choices and
speculation, and how far its prefill has come."""

from __future__ import annotations

import time

import numpy as np

from kvforge.runtime.drivers.handles import RequestHandle
from kvforge.runtime.drivers.images import RowImages
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
