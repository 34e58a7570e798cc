"""The scheduler runs only the rows in use (runtime/drivers/scheduler.py): running requests stay packed at
the front of the batch cache, a decode step binds the smallest batch bucket holding them, and
requests that join, leave or are moved still give their solo greedy tokens. Cancelling a row mid-batch
and refusing a backend without row operations are checked on the fake backend (tests/runtime/test_fake_scheduler.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.core.errors import InputError
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.backends.kv_cache import KVCache
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Scheduler

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 300, 12, 12, 8, 90], [1, 2, 3], [44] * 9]


def _solo(generator: Generator, prompt: list[int], n: int) -> list[int]:
    return generator.generate([prompt], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]


def _request(prompt: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(prompt, n, SamplingConfig(greedy=True), ignore_eos=True)


@pytest.fixture(params=[("ort", "ort-cpu"), ("onnx", "ort-cpu"), ("trt", "emulate")], ids=lambda p: "-".join(p))
def recorded(request, exported, monkeypatch):
    """A generator on each backend that runs on the CPU, a 4-row scheduler on it (not started: tests
    submit first, so that the steps do not depend on thread timing), and the (bound batch, running
    mask) of its every decode step."""
    from kvforge.runtime.backends import emulate

    monkeypatch.setattr(emulate, "DEFAULT_MODE", "reference")  # the numpy reference serves the plugin node
    target, backend = request.param
    generator = Generator(exported("llama-tiny", target), backend=backend)
    scheduler = Scheduler(generator, max_batch=4, max_seq_len=128, prefill_chunk=8)
    steps: list[tuple[int, np.ndarray]] = []
    decode = generator.backend.decode

    def spy(slot, token_ids, running=None):
        if np.shares_memory(slot.cache.past_lens, scheduler.slot.cache.past_lens):
            steps.append((slot.cache.batch, np.ones(slot.cache.batch, bool) if running is None else running.copy()))
        return decode(slot, token_ids, running)

    monkeypatch.setattr(generator.backend, "decode", spy)
    yield generator, scheduler, steps
    scheduler.close()


def _check_packed_buckets(steps: list[tuple[int, np.ndarray]]) -> set[int]:
    """Every step ran rows 0..n-1 in the smallest bucket (1, 2, 4) holding n; the buckets seen."""
    for batch, running in steps:
        n = int(running.sum())
        assert running[:n].all() and not running[n:].any(), running  # packed at the front
        assert batch == next(k for k in (1, 2, 4) if k >= n), (batch, n)
    return {batch for batch, _ in steps}


def test_rows_move_and_buckets_follow_the_running_count(recorded) -> None:
    generator, scheduler, steps = recorded
    # Short requests first: they finish while later rows still run, so those rows are moved down.
    lengths = [3, 17, 5, 11, 8]
    expected = [_solo(generator, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    handles = [scheduler.submit(_request(p, n)) for p, n in zip(PROMPTS, lengths, strict=True)]
    scheduler.start()
    for handle, want in zip(handles, expected, strict=True):
        assert handle.result()[0] == want
    assert _check_packed_buckets(steps) == {1, 2, 4}
    assert steps[-1][0] == 1  # the longest request ends alone, in a batch of one


def test_multi_turn_reuse_after_the_row_moved(recorded) -> None:
    generator, scheduler, steps = recorded
    history = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    short = scheduler.submit(_request(PROMPTS[0], 6))  # row 0, ends first: the conversation moves to row 0
    first = scheduler.submit(_request(history, 12))
    scheduler.start()
    assert short.result()[0] == _solo(generator, PROMPTS[0], 6)
    tokens, _, done = first.result()
    assert tokens == _solo(generator, history, 12) and done.cached_tokens == 0
    assert any(int(running.sum()) == 2 for _, running in steps)  # they did run together
    # The next turn reuses the KV rows stored from the moved row.
    history = history + tokens + [30, 31]
    tokens, _, done = scheduler.submit(_request(history, 6)).result()
    assert done.cached_tokens == len(history) - 3 and done.prefilled_tokens == 3
    assert tokens == _solo(generator, history, 6)
    _check_packed_buckets(steps)


def test_first_rows_share_the_cache_memory() -> None:
    cache = KVCache(num_layers=2, batch=4, num_kv_heads=2, capacity=8, head_dim=4)
    view = cache.first_rows(2)
    assert view.batch == 2 and view.addresses() == cache.addresses()  # leading rows start at the same address
    view.host_layers()[1][0][1, 0, 3, 2] = 7.0
    view.past_lens[1] = 5
    assert cache.host_layers()[1][0][1, 0, 3, 2] == 7.0 and cache.past_lens[1] == 5
    assert list(view.keys[0].shape()) == [2, 2, 8, 4]
    with pytest.raises(InputError, match="rows must be between 1 and the cache's 4, got 5"):
        cache.first_rows(5)

