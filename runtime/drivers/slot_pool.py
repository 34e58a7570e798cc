"""Slots (KV cache + bindings) taken per request and given back, so threads and open streams never
share a cache while the backend's sessions / engines (one weight copy) are shared.

Idle slots are kept for reuse (their buffers and bindings), at most `max_idle`; capacities come in
buckets, so requests of different lengths share slots and memory stays flat over long runs.
"""

from __future__ import annotations

import threading

from kvforge.runtime.backends.backend import Backend, Slot

DEFAULT_MAX_IDLE = 4


class SlotPool:
    def __init__(self, backend: Backend, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        self.backend = backend
        self.max_idle = max_idle
        self._idle: list[Slot] = []
        self._lock = threading.Lock()
        self.last: Slot | None = None  # the most recently taken slot (tests, debugging)

    def acquire(self, batch: int, capacity: int) -> Slot:
        """An idle slot of this shape, or a new one."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                slot = self._idle[i]
                if slot.cache.batch == batch and slot.cache.capacity == capacity:
                    del self._idle[i]
                    self.last = slot
                    return slot
        slot = self.backend.allocate(batch, capacity)
        with self._lock:
            self.last = slot
        return slot

    def release(self, slot: Slot) -> None:
        with self._lock:
            self._idle.append(slot)
            del self._idle[: max(0, len(self._idle) - self.max_idle)]

    @property
    def idle(self) -> int:
        """How many slots wait for reuse."""
        with self._lock:
            return len(self._idle)
