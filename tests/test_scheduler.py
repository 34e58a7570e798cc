"""Continuous batching (runtime/scheduler.py): requests that join and leave one running batch give
the tokens they give alone (Generator.generate, greedy); multi-turn reuse prefills only new tokens
and gives the same tokens as a full prefill; stops, limits, cancellation and a full queue."""

from __future__ import annotations

import threading

import pytest

from kvforge.core.errors import CapacityError, InputError, QueueFullError
from kvforge.runtime import FinishReason, GenerationRequest, Generator
from kvforge.runtime.sampling import SamplingConfig
from kvforge.runtime.scheduler import Delta, Done, Scheduler

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 300, 12, 12, 8, 90], [1, 2, 3], list(range(100, 140)),
           [44] * 9, [9, 8, 7, 6, 5, 4, 3, 2]]


def _solo(generator: Generator, prompt: list[int], n: int) -> list[int]:
    return generator.generate([prompt], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]


@pytest.fixture(scope="module", params=["ort", "onnx"])
def served(request, exported):
    generator = Generator(exported("llama-tiny", request.param))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=256, prefill_chunk=8).start()
    yield generator, scheduler
    scheduler.close()


def _request(prompt: list[int], n: int = 16, **options) -> GenerationRequest:
    return GenerationRequest(prompt, n, SamplingConfig(greedy=True), ignore_eos=True, **options)


def test_requests_in_one_batch_give_their_solo_tokens(served) -> None:
    generator, scheduler = served
    # 7 requests, 3 rows: they queue, join as rows free up, and prompts over 8 tokens are chunked.
    handles = [scheduler.submit(_request(p, 12 + i)) for i, p in enumerate(PROMPTS)]
    for handle, prompt, i in zip(handles, PROMPTS, range(len(PROMPTS)), strict=True):
        tokens, _, done = handle.result()
        assert tokens == _solo(generator, prompt, 12 + i), i
        assert done.finish_reason == FinishReason.LENGTH == "length" and done.completion_tokens == 12 + i
    assert scheduler.snapshot()["running"] == 0


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


def test_multi_turn_prefills_only_the_new_tokens(served) -> None:
    generator, scheduler = served
    history = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    previous_written, new_user = 0, []
    for turn in range(3):
        tokens, _, done = scheduler.submit(_request(history, 8)).result()
        assert tokens == _solo(generator, history, 8), turn  # same as prefilling the whole history
        if turn == 0:
            assert done.cached_tokens == 0 and done.prefilled_tokens == len(history)
        else:
            # The previous turn wrote its prompt and all its tokens but the last one.
            assert done.cached_tokens == previous_written
            assert done.prefilled_tokens == len(history) - previous_written == 1 + len(new_user)
        previous_written = len(history) + len(tokens) - 1
        new_user = [30 + turn, 31 + turn, 32 + turn]
        history = history + tokens + new_user


def test_stop_token_stop_string_and_cancel(served, exported) -> None:
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


def test_bad_requests_and_a_full_queue(exported) -> None:
    generator = Generator(exported("llama-tiny", "ort"))
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=64, max_queue=2)  # not started: nothing drains
    with pytest.raises(CapacityError, match="needs 79 positions; this server holds 64 per request"):
        scheduler.submit(_request(list(range(3, 43)), 40))
    # Prompts and limits are checked where the Generator checks them (runtime/prompts.py, request.py).
    with pytest.raises(InputError, match="no prompts given"):
        scheduler.submit(_request([], 4))
    with pytest.raises(InputError, match=r"token id 99999, outside the vocabulary \[0, 512\)"):
        scheduler.submit(_request([5, 99999], 4))
    with pytest.raises(InputError, match="max_new_tokens must be an integer >= 1"):
        scheduler.submit(_request([5], 0))
    with pytest.raises(InputError, match="one prompt per request, got 2"):
        scheduler.submit(_request([[5], [6]], 4))
    scheduler.submit(_request([5], 4))
    scheduler.submit(_request([6], 4))
    with pytest.raises(QueueFullError, match=r"2 requests are already waiting \(max_queue 2\)"):
        scheduler.submit(_request([7], 4))
    with pytest.raises(InputError, match="max_seq_len must be between 2 and the export's"):
        Scheduler(generator, max_seq_len=10**9)
    scheduler.close()


def test_an_internal_error_in_one_row_ends_that_request_alone(exported) -> None:
    """A failure that belongs to one request (its consumer raising on a token, its prefix copy failing)
    ends or touches that request only; the others in the batch answer as they do alone (issue 43)."""
    generator = Generator(exported("llama-tiny", "ort"))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=256, prefill_chunk=8).start()
    try:
        seen = []

        def consumer_that_breaks(event) -> None:
            seen.append(event)
            if isinstance(event, Delta) and len(seen) == 3:
                raise RuntimeError("the client's queue is gone")

        broken = scheduler.submit(_request(PROMPTS[0], 12), on_event=consumer_that_breaks)
        others = [scheduler.submit(_request(p, 12)) for p in PROMPTS[1:3]]
        for handle, prompt in zip(others, PROMPTS[1:3], strict=True):
            tokens, _, done = handle.result()
            assert tokens == _solo(generator, prompt, 12) and done.error is None
        done = [e for e in seen if isinstance(e, Done)]
        assert len(done) == 1 and done[0].finish_reason == FinishReason.ERROR and "the client's queue is gone" in \
            done[0].error and broken.done is not None
        # The prefix store failing (a cache for later requests) does not touch the answer.
        original = scheduler.prefixes.store
        scheduler.prefixes.store = lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room"))
        try:
            tokens, _, done = scheduler.submit(_request(PROMPTS[3], 8)).result()
        finally:
            scheduler.prefixes.store = original
        assert tokens == _solo(generator, PROMPTS[3], 8) and done.error is None
        stats = scheduler.snapshot()
        assert stats["prefix_store_errors"] == 1 and stats["running"] == 0
    finally:
        scheduler.close()
