"""The prefix store's radix index against a brute-force scan of its entries (issue 43, 2): the same
prefix length on every lookup, through stores, supersessions and evictions."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime.drivers.prefix_store import PrefixStore


def _kv(tokens: list[int]) -> list[tuple[np.ndarray, ...]]:
    # The KV stands for its tokens: a lookup must hand back the entry it names.
    return [(np.asarray(tokens, dtype=np.float32),)]


def _brute(entries: list[list[int]], prompt: list[int], exact_only: bool) -> int:
    best = 0
    for stored in entries:
        n = min(len(stored), len(prompt) - 1)
        common = next((i for i in range(n) if stored[i] != prompt[i]), n)
        if exact_only and common < len(stored):
            continue
        best = max(best, common)
    return best


@pytest.mark.parametrize("exact_only", [False, True])
def test_lookups_equal_a_scan_of_every_entry(exact_only: bool) -> None:
    rng = np.random.default_rng(7)
    # A small alphabet and short sequences: many shared prefixes, splits, merges and supersessions.
    store = PrefixStore(budget_bytes=40 * 4 * 8, exact_only=exact_only, max_entries=25)
    live: list[list[int]] = []
    for step in range(3000):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 9))).tolist()
        if step % 2:
            got, kv = store.lookup(tokens)
            assert got == _brute(live, tokens, exact_only), (step, tokens, live)
            if got:
                held = kv[0][0].astype(int).tolist()
                assert held[:got] == tokens[:got] and (not exact_only or len(held) == got)
                live.remove(held)  # now the most recently used
                live.append(held)
            continue
        store.store(tokens, _kv(tokens))
        live = [old for old in live if old != tokens[: len(old)]] + [tokens]
        while sum(len(t) * 4 for t in live) > store.budget_bytes or len(live) > store.max_entries:
            live.pop(0)
        assert len(store) == len(live) and store.bytes == sum(len(t) * 4 for t in live)


def test_an_emptied_store_has_an_empty_index() -> None:
    store = PrefixStore(1 << 20, max_entries=2)
    for tokens in ([1, 2, 3], [1, 2, 4], [1, 5], [6]):
        store.store(tokens, _kv(tokens))
    assert store.lookup([1, 2, 3, 0])[0] == 1  # [1, 2, 3] and [1, 2, 4] evicted: [1, 5] shares one token
    assert store.lookup([6, 0])[0] == 1 and store.lookup([1, 5, 0])[0] == 2
    store.store([7] * 3, [(np.zeros(10**6, np.float32),)])  # over the budget: not stored
    assert len(store) == 2
    store.max_entries = 0
    store.store([9], _kv([9]))
    assert len(store) == 0 and store.bytes == 0 and not store._root.edges and store._root.count == 0
