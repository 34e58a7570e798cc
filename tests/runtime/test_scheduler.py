"""Continuous batching (runtime/drivers/scheduler.py) on real exports: requests that join and leave one running
batch give the tokens they give alone (Generator.generate, greedy); stops and cancellation. One real
export per test: the rest (multi-turn reuse, limits, a full queue, one row's internal error, and these
again) runs on the fake backend (tests/runtime/test_fake_scheduler.py), and tests/runtime/test_scheduler_rows.py runs
rows moving and multi-turn reuse on every CPU backend."""

from __future__ import annotations

import threading

import pytest

from kvforge.runtime import FinishReason, GenerationRequest, Generator
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Delta, Done, Scheduler

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 300, 12, 12, 8, 90], [1, 2, 3], list(range(100, 140)),
           [44] * 9, [9, 8, 7, 6, 5, 4, 3, 2]]


def _solo(generator: Generator, prompt: list[int], n: int) -> list[int]:
    return generator.generate([prompt], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]


@pytest.fixture(scope="module")
def served(request, exported):
    """A started 3-row scheduler on the export of `request.param` (a target: each test names its own)."""
    generator = Generator(exported("llama-tiny", request.param))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=256, prefill_chunk=8).start()
    yield generator, scheduler
    scheduler.close()


def _request(prompt: list[int], n: int = 16, **options) -> GenerationRequest:
    return GenerationRequest(prompt, n, SamplingConfig(greedy=True), ignore_eos=True, **options)


@pytest.mark.parametrize("served", ["ort"], indirect=True)
def test_requests_in_one_batch_give_their_solo_tokens(served) -> None:
    generator, scheduler = served
    # 7 requests, 3 rows: they queue, join as rows free up, and prompts over 8 tokens are chunked.
    handles = [scheduler.submit(_request(p, 12 + i)) for i, p in enumerate(PROMPTS)]
    for handle, prompt, i in zip(handles, PROMPTS, range(len(PROMPTS)), strict=True):
        tokens, _, done = handle.result()
        assert tokens == _solo(generator, prompt, 12 + i), i
        assert done.finish_reason == FinishReason.LENGTH == "length" and done.completion_tokens == 12 + i
    assert scheduler.snapshot()["running"] == 0


@pytest.mark.parametrize("served", ["ort"], indirect=True)
def test_requests_arriving_mid_generation(served) -> None:
    generator, scheduler = served
    first = scheduler.submit(_request(PROMPTS[1], 30))
    seen = threading.Event()
    late: list = []
    for event in first:
        if isinstance(event, Delta) and not seen.is_set():
            seen.set()
            late = [scheduler.submit(_request(p, 10)) for p in PROMPTS[2:5]]
        if isinstance(event, Done):
            break
    assert first.done is not None and first.done.finish_reason == "length"
    for handle, prompt in zip(late, PROMPTS[2:5], strict=True):
        assert handle.result()[0] == _solo(generator, prompt, 10)


@pytest.mark.parametrize("served", ["onnx"], indirect=True)  # the only real stop / cancel test on onnx
def test_stop_token_stop_string_and_cancel(served) -> None:
    generator, scheduler = served
    solo = _solo(generator, PROMPTS[0], 20)
    tokens, _, done = scheduler.submit(_request(PROMPTS[0], 20, stop_token_ids=frozenset({solo[5]}))).result()
    assert tokens == solo[: solo.index(solo[5]) + 1] and done.finish_reason == "stop"

    text = generator.tokenizer.decode(solo)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    _, got, done = scheduler.submit(_request(PROMPTS[0], 20, stop=(stop,))).result()
    assert got == text[: text.index(stop)] and done.finish_reason == "stop"

    handle = scheduler.submit(_request(PROMPTS[1], 200))
    other = scheduler.submit(_request(PROMPTS[2], 12))
    for event in handle:
        if isinstance(event, Delta):
            handle.cancel()
    assert handle.done is not None and handle.done.finish_reason == "cancelled"
    assert handle.done.completion_tokens < 200
    assert other.result()[0] == _solo(generator, PROMPTS[2], 12)
