"""The serving scheduler's multi-turn reuse: the KV rows of finished requests, by their token sequence,
bounded in bytes (least recently used first out). A later prompt that starts with the same tokens (the
next turn of a chat) copies those rows and prefills only what follows: the KV of position t depends only
on tokens 0..t, so the result is the same as prefilling everything. The rows are host copies
(Backend.read_rows), whatever device the cache lives on.

A recurrent layer's state (Mamba, gated DeltaNet, ...) is that of exactly the stored tokens: it cannot
be cut back to a shorter prefix. With `exact_only` (a model with such layers) an entry is used only
where the prompt continues all of it."""

from __future__ import annotations

import collections
import itertools

import numpy as np


class PrefixStore:
    """KV rows of finished requests by their token sequence, least recently used evicted first, bounded
    in bytes and in entries."""

    MAX_ENTRIES = 4096  # a bound on the count too: each lookup scans the entries (an index is issue 43's next step)

    def __init__(self, budget_bytes: int, exact_only: bool = False, max_entries: int = MAX_ENTRIES) -> None:
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.exact_only = exact_only
        self.bytes = 0
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, list[tuple[np.ndarray, ...]]]] = (
            collections.OrderedDict())
        self._ids = itertools.count()
        self.hits = 0

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[np.ndarray, ...]] | None]:
        """The longest stored prefix of `prompt` (at most len(prompt) - 1 positions: the last prompt
        token is always run, for its logits) and that entry's KV (rows beyond it are not used)."""
        best, best_key = 0, None
        tokens = np.asarray(prompt, dtype=np.int64)
        for key, (stored, _) in self._entries.items():
            n = min(len(stored), len(tokens) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(stored[:n] != tokens[:n])
            common = int(differ[0]) if differ.size else n
            if self.exact_only and common < len(stored):  # a state cannot be cut back to `common` tokens
                continue
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        return best, self._entries[best_key][1]

    def store(self, tokens: list[int], kv: list[tuple[np.ndarray, ...]]) -> None:
        size = _nbytes(kv)
        if size > self.budget_bytes or not tokens:
            return
        new = np.asarray(tokens, dtype=np.int64)
        # An entry that is a prefix of the new one is superseded by it.
        for key, (stored, _kv) in list(self._entries.items()):
            if len(stored) <= len(new) and np.array_equal(stored, new[: len(stored)]):
                self._drop(key)
        self._entries[next(self._ids)] = (new, kv)
        self.bytes += size
        while self.bytes > self.budget_bytes or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        _, kv = self._entries.pop(key)
        self.bytes -= _nbytes(kv)

    def __len__(self) -> int:
        return len(self._entries)


def _nbytes(kv: list[tuple[np.ndarray, ...]]) -> int:
    return sum(array.nbytes for layer in kv for array in layer)
