"""The serving scheduler's multi-turn reuse: the KV rows of finished requests, by their token sequence,
bounded in bytes and in entries (least recently used first out). A later prompt that starts with the
same tokens (the next turn of a chat) copies those rows and prefills only what follows: the KV of
position t depends only on tokens 0..t, so the result is the same as prefilling everything. The rows are
host copies (Backend.read_rows), whatever device the cache lives on.

The entries are indexed by a radix tree of their tokens (edges hold runs of tokens, as int64 bytes), so
a lookup or a store costs the prompt's length, not the number of entries.

A recurrent layer's state (Mamba, gated DeltaNet, ...) is that of exactly the stored tokens: it cannot
be cut back to a shorter prefix. With `exact_only` (a model with such layers) an entry is used only
where the prompt continues all of it."""

from __future__ import annotations

import array
import collections
import itertools

import numpy as np

KV = list[tuple[np.ndarray, ...]]
W = 8  # bytes a token: the index holds token runs as bytes, compared by memcmp without touching int objects


class _Node:
    """A radix-tree node: the run of tokens on the edge into it (`label`), the nodes below by their
    first token, the entry whose tokens end here (at most one: an equal entry supersedes the old), and
    how many entries end at or below it."""

    __slots__ = ("label", "edges", "end", "count")

    def __init__(self, label: bytes, end: int = -1, count: int = 0) -> None:
        self.label = label
        self.edges: dict[bytes, _Node] = {}
        self.end = end
        self.count = count


def _common(label: bytes, tokens: bytes, at: int) -> int:
    """How many bytes (whole tokens) of `label` `tokens[at:]` starts with: slice comparisons (memcmp)
    halving the range, so a long shared run costs no Python loop over its tokens."""
    n = min(len(label), len(tokens) - at) // W
    if label[: n * W] == tokens[at:at + n * W]:
        return n * W
    lo, hi = 0, n  # label's first lo tokens match; the first difference is before token hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if label[lo * W:mid * W] == tokens[at + lo * W:at + mid * W]:
            lo = mid
        else:
            hi = mid
    return lo * W


def _bytes(tokens: list[int]) -> bytes:
    return array.array("q", tokens).tobytes()


class PrefixStore:
    """KV rows of finished requests by their token sequence, least recently used evicted first, bounded
    in bytes and in entries."""

    MAX_ENTRIES = 100_000

    def __init__(self, budget_bytes: int, exact_only: bool = False, max_entries: int = MAX_ENTRIES) -> None:
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.exact_only = exact_only
        self.bytes = 0
        self._entries: collections.OrderedDict[int, tuple[bytes, KV]] = collections.OrderedDict()
        self._root = _Node(b"")
        self._ids = itertools.count()
        self.hits = 0

    def lookup(self, prompt: list[int]) -> tuple[int, KV | None]:
        """The longest stored prefix of `prompt` (at most len(prompt) - 1 positions: the last prompt
        token is always run, for its logits) and that entry's KV (rows beyond it are not used)."""
        tokens = _bytes(prompt[: max(len(prompt) - 1, 0)])
        best, best_key = 0, -1
        node, depth = self._root, 0
        while True:
            if node.end >= 0:  # an entry ending here is a whole prefix of the prompt: usable even exact_only
                best, best_key = depth, node.end
            child = node.edges.get(tokens[depth:depth + W]) if depth < len(tokens) else None
            if child is None:
                break
            label = child.label
            if tokens[depth:depth + len(label)] == label:  # the usual case, without _common's call
                node, depth = child, depth + len(label)
                continue
            # The prompt leaves (or ends inside) this edge: every entry below shares its first tokens.
            shared = depth + _common(label, tokens, depth)
            if not self.exact_only and shared > best:
                best, best_key = shared, self._any_entry(child)
            break
        if not self.exact_only and node.count and depth > best:
            best, best_key = depth, self._any_entry(node)
        if best_key < 0 or best == 0:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        return best // W, self._entries[best_key][1]

    def store(self, tokens: list[int], kv: KV) -> None:
        size = _nbytes(kv)
        if size > self.budget_bytes or not tokens:
            return
        new = _bytes(tokens)
        # An entry that is a prefix of the new one (or equal: one ending on its path) is superseded by it.
        for key in self._ends_on_path(new):
            self._drop(key)
        key = next(self._ids)
        self._insert(new, key)
        self._entries[key] = (new, kv)
        self.bytes += size
        while self.bytes > self.budget_bytes or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def __len__(self) -> int:
        return len(self._entries)

    def _any_entry(self, node: _Node) -> int:
        while node.end < 0:  # count > 0 below: some edge leads to an entry
            node = next(child for child in node.edges.values() if child.count)
        return node.end

    def _ends_on_path(self, tokens: bytes) -> list[int]:
        found, node, depth = [], self._root, 0
        while True:
            if node.end >= 0:
                found.append(node.end)
            child = node.edges.get(tokens[depth:depth + W])
            if child is None or tokens[depth:depth + len(child.label)] != child.label:
                return found
            node, depth = child, depth + len(child.label)

    def _insert(self, tokens: bytes, key: int) -> None:
        node, depth = self._root, 0
        while True:
            node.count += 1
            if depth == len(tokens):
                node.end = key
                return
            first = tokens[depth:depth + W]
            child = node.edges.get(first)
            if child is None:
                node.edges[first] = _Node(tokens[depth:], end=key, count=1)
                return
            label = child.label
            matched = len(label) if tokens[depth:depth + len(label)] == label else _common(label, tokens, depth)
            if matched < len(label):  # split the edge where the new tokens leave it
                middle = _Node(label[:matched], count=child.count)
                child.label = label[matched:]
                middle.edges[child.label[:W]] = child
                node.edges[first] = middle
                child = middle
            node, depth = child, depth + matched

    def _remove(self, tokens: bytes) -> None:
        path: list[tuple[_Node, bytes]] = []  # (node, first token of the edge taken from it)
        node, depth = self._root, 0
        while depth < len(tokens):
            first = tokens[depth:depth + W]
            path.append((node, first))
            node = node.edges[first]
            depth += len(node.label)
        node.end = -1
        self._root.count -= 1
        for parent, first in path:
            child = parent.edges[first]
            child.count -= 1
            if not child.count:  # nothing else at or below: cut the branch
                del parent.edges[first]
                break
        for parent, first in reversed(path):  # merge pass-through nodes into their one edge, deepest first
            child = parent.edges.get(first)
            if child is not None and child.end < 0 and len(child.edges) == 1:
                (below,) = child.edges.values()
                below.label = child.label + below.label
                parent.edges[first] = below

    def _drop(self, key: int) -> None:
        tokens, kv = self._entries.pop(key)
        self._remove(tokens)
        self.bytes -= _nbytes(kv)


def _nbytes(kv: KV) -> int:
    return sum(part.nbytes for layer in kv for part in layer)
