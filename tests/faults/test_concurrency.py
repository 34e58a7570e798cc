"""The fault and abuse suite, part 3: one Generator shared by threads and streams, and long runs.

The oracle is the same Generator run sequentially: greedy decoding is deterministic, so any
difference under concurrency is a shared-state bug (the bug this guards against gave wrong tokens
and spurious capacity errors with 8 threads).
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvforge.runtime import Generator

pytest.importorskip("torch")

THREADS, PER_THREAD = 8, 20


def _request(i: int) -> tuple[list[int], int]:
    """Requests of different prompt lengths and lengths, so that threads need caches of different shapes."""
    prompt = [1] + [(7 * i + 3 * j) % 500 + 5 for j in range(2 + i % 9)]
    return prompt, 4 + i % 13


@pytest.fixture(scope="module")
def folder(exported) -> Path:
    return exported("llama-tiny")


@pytest.fixture(scope="module")
def sequential(folder) -> dict[int, list[int]]:
    gen = Generator(folder, threads=1)
    out = {}
    for i in range(THREADS * PER_THREAD):
        prompt, new = _request(i)
        out[i] = gen.generate([prompt], max_new_tokens=new, greedy=True, ignore_eos=True).tokens[0]
    return out


def test_requests_differ_so_the_check_can_fail(sequential) -> None:
    assert len({tuple(tokens) for tokens in sequential.values()}) > THREADS * PER_THREAD // 2


def test_8_threads_x_20_generations_on_one_generator_equal_sequential(folder, sequential) -> None:
    gen = Generator(folder, threads=1)
    barrier = threading.Barrier(THREADS)

    def worker(t: int) -> dict[int, list[int]]:
        barrier.wait()  # start together, so the runs really overlap
        got = {}
        for k in range(PER_THREAD):
            i = t * PER_THREAD + k
            prompt, new = _request(i)
            got[i] = gen.generate([prompt], max_new_tokens=new, greedy=True, ignore_eos=True).tokens[0]
        return got

    with ThreadPoolExecutor(THREADS) as pool:
        results = {}
        for part in pool.map(worker, range(THREADS)):
            results.update(part)
    assert results == sequential


def test_two_streams_open_at_once_do_not_corrupt_each_other(folder, sequential) -> None:
    gen = Generator(folder)
    (p1, n1), (p2, n2) = _request(3), _request(12)
    first = gen.stream([p1], max_new_tokens=n1, greedy=True, ignore_eos=True)
    second = gen.stream([p2], max_new_tokens=n2, greedy=True, ignore_eos=True)
    a, b = iter(first), iter(second)
    done = [False, False]
    while not all(done):  # interleave the two streams step by step
        for k, it in enumerate((a, b)):
            if not done[k]:
                done[k] = next(it, None) is None
    assert first.result.tokens[0] == sequential[3]
    assert second.result.tokens[0] == sequential[12]


def test_an_abandoned_stream_does_not_disturb_later_requests(folder, sequential) -> None:
    gen = Generator(folder)
    prompt, new = _request(5)
    stream = gen.stream([prompt], max_new_tokens=new, greedy=True, ignore_eos=True)
    next(iter(stream))  # one step, then dropped mid-generation
    del stream
    gc.collect()
    for i in (5, 6):
        prompt, new = _request(i)
        assert gen.generate([prompt], max_new_tokens=new, greedy=True, ignore_eos=True).tokens[0] == sequential[i]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        import os

        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_500_generations_keep_resident_memory_flat(folder) -> None:
    gen = Generator(folder, threads=1)
    prompts = [_request(i) for i in range(10)]

    def run(count: int) -> None:
        for i in range(count):
            prompt, new = prompts[i % len(prompts)]
            gen.generate([prompt], max_new_tokens=new, greedy=True, ignore_eos=True)

    run(50)  # warm-up: pool slots, ORT's arenas and caches
    gc.collect()
    before = _rss_bytes()
    run(500)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 4 * 1024 * 1024, f"resident memory grew by {grown / 1e6:.1f} MB over 500 generations"
    assert gen.slots.idle <= gen.max_idle_slots
