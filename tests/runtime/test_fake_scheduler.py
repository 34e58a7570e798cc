"""Continuous batching (runtime/drivers/scheduler.py) on the fake backend (tests/fake_backend.py): requests joining
and leaving one batch, packed rows and batch buckets, chunked prefill, multi-turn prefix reuse through
row reads / writes, cancellation, stops, limits and speculation, each answer checked against the fake
model's own greedy loop (FakeModel.greedy), which never touches the runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_backend import FakeModel, make_generator, without_rows, write_export

from kvforge.core.errors import BackendUnavailableError, CapacityError, InputError, QueueFullError
from kvforge.runtime import FinishReason, GenerationRequest, LoadedExport, Speculation
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Delta, Done, Scheduler

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 250, 12, 12, 8, 90], [1, 2, 3], list(range(100, 140)),
           [44] * 9, [9, 8, 7, 6, 5, 4, 3, 2]]
REPEATING = [[1, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70], [1, 7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3]]


def _request(prompt: list[int], n: int = 16, **options) -> GenerationRequest:
    return GenerationRequest(prompt, n, SamplingConfig(greedy=True), ignore_eos=True, **options)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_export(tmp_path_factory.mktemp("fake") / "export")


@pytest.fixture
def recorded(folder: Path) -> Iterator[tuple[FakeModel, Scheduler, list[tuple[int, np.ndarray]]]]:
    """A generator, a 4-row scheduler on it (not started: tests submit first, so that the steps do not
    depend on thread timing), and the (bound batch, running mask) of its every batch decode step."""
    generator = make_generator(folder)
    scheduler = Scheduler(generator, max_batch=4, max_seq_len=128, prefill_chunk=8)
    steps: list[tuple[int, np.ndarray]] = []
    decode = generator.backend.decode

    def spy(slot, token_ids, running=None) -> np.ndarray:
        if np.shares_memory(slot.cache.past_lens, scheduler.slot.cache.past_lens):
            steps.append((slot.cache.batch, np.ones(slot.cache.batch, bool) if running is None else running.copy()))
        return decode(slot, token_ids, running)

    generator.backend.decode = spy
    yield generator.backend.model, scheduler, steps
    scheduler.close()


def _check_packed_buckets(steps: list[tuple[int, np.ndarray]]) -> set[int]:
    """Every step ran rows 0..n-1 in the smallest bucket (1, 2, 4) holding n; the buckets seen."""
    for batch, running in steps:
        n = int(running.sum())
        assert running[:n].all() and not running[n:].any(), running  # packed at the front
        assert batch == next(k for k in (1, 2, 4) if k >= n), (batch, n)
    return {batch for batch, _ in steps}


def test_queued_requests_join_and_leave_and_give_their_reference(recorded) -> None:
    model, scheduler, steps = recorded
    # 7 requests, 4 rows: they queue, join as rows free up, prompts over 8 tokens are prefilled in chunks.
    handles = [scheduler.submit(_request(p, 12 + i)) for i, p in enumerate(PROMPTS)]
    scheduler.start()
    for i, (handle, prompt) in enumerate(zip(handles, PROMPTS, strict=True)):
        tokens, _, done = handle.result()
        assert tokens == model.greedy(prompt, 12 + i), i
        assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("length", 12 + i, len(prompt))
    assert _check_packed_buckets(steps) == {1, 2, 4} and steps[-1][0] == 1
    snapshot = scheduler.snapshot()
    assert snapshot["running"] == 0 and snapshot["prefilled_tokens"] == sum(map(len, PROMPTS))
    # 40 tokens in chunks of 8: five prefill calls of the staging row for that prompt alone.
    assert sum(1 for phase, batch, width in scheduler.backend.calls if phase == "prefill") == 1 + 3 + 1 + 1 + 5 + 2 + 1


def test_rows_move_and_buckets_follow_the_running_count(recorded) -> None:
    model, scheduler, steps = recorded
    lengths = [3, 17, 5, 11, 8]  # short ones finish while later rows run: those rows are moved down
    handles = [scheduler.submit(_request(p, n)) for p, n in zip(PROMPTS[:5], lengths, strict=True)]
    scheduler.start()
    assert [h.result()[0] for h in handles] == [model.greedy(p, n) for p, n in zip(PROMPTS[:5], lengths, strict=True)]
    assert _check_packed_buckets(steps) == {1, 2, 4}


def test_cancel_mid_batch(recorded) -> None:
    model, scheduler, steps = recorded
    middle: list = []

    def cancel_at_third_token(event) -> None:  # on the scheduler thread, so the step it stops at is fixed
        middle.append(event)
        if sum(isinstance(e, Delta) for e in middle) == 3:
            handles[1].cancel()

    handles = [scheduler.submit(_request(PROMPTS[0], 14)),
               scheduler.submit(_request(PROMPTS[1], 100), cancel_at_third_token),
               scheduler.submit(_request(PROMPTS[2], 14))]
    scheduler.start()
    for i in (0, 2):
        assert handles[i].result()[0] == model.greedy(PROMPTS[i], 14)
    assert (handles[1].done.finish_reason, handles[1].done.completion_tokens) == (FinishReason.CANCELLED, 3)
    # Rows 0-2 ran together once; then the middle row was cancelled and the last one moved into it.
    assert [int(r.sum()) for _, r in steps] == [1, 1, 1, 2, 3] + [2] * 8 + [1] * 4
    _check_packed_buckets(steps)


def test_multi_turn_reuses_the_rows_of_a_moved_request(recorded) -> None:
    model, scheduler, steps = recorded
    history = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    short = scheduler.submit(_request(PROMPTS[0], 6))  # row 0, ends first: the conversation moves to row 0
    first = scheduler.submit(_request(history, 12))
    scheduler.start()
    assert short.result()[0] == model.greedy(PROMPTS[0], 6)
    tokens, _, done = first.result()
    assert tokens == model.greedy(history, 12) and done.cached_tokens == 0
    assert any(int(running.sum()) == 2 for _, running in steps)  # they did run together
    for turn in range(3):  # each turn reuses the prompt and all but the last token of the one before
        written = len(history) + len(tokens) - 1
        history = history + tokens + [30 + turn, 31 + turn]
        tokens, _, done = scheduler.submit(_request(history, 6)).result()
        assert tokens == model.greedy(history, 6), turn
        assert (done.cached_tokens, done.prefilled_tokens) == (written, 3)
    assert scheduler.snapshot()["prefix_entries"] >= 1


def test_a_corrupted_prefix_entry_is_caught_by_the_reference(recorded) -> None:
    # The check above can fail: a prefix entry whose KV rows are not the tokens' changes the answer.
    model, scheduler, _ = recorded
    history = list(range(60, 75))
    tokens, _, _ = scheduler.start().submit(_request(history, 4)).result()
    kept = history + tokens[:-1]
    _, rows = scheduler.prefixes.lookup(kept)
    scheduler.prefixes.store(kept, [(k, v[:, ::-1].copy()) for k, v in rows])  # positions reversed
    follow = kept + [tokens[-1], 7]
    got, _, done = scheduler.submit(_request(follow, 8)).result()
    assert done.cached_tokens == len(kept) and got != model.greedy(follow, 8)


def test_stop_token_stop_string_and_cancel(recorded) -> None:
    model, scheduler, _ = recorded
    scheduler.start()
    solo = model.greedy(PROMPTS[0], 20)
    tokens, _, done = scheduler.submit(_request(PROMPTS[0], 20, stop_token_ids=frozenset({solo[5]}))).result()
    assert tokens == solo[: solo.index(solo[5]) + 1] and done.finish_reason == "stop"
    text = scheduler.export.tokenizer.decode(solo)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    _, got, done = scheduler.submit(_request(PROMPTS[0], 20, stop=(stop,))).result()
    assert got == text[: text.index(stop)] and done.finish_reason == "stop"
    handle = scheduler.submit(_request(PROMPTS[1], 100))
    other = scheduler.submit(_request(PROMPTS[2], 12))
    for event in handle:
        if isinstance(event, Delta):
            handle.cancel()
    assert handle.done.finish_reason == "cancelled" and handle.done.completion_tokens < 100
    assert other.result()[0] == model.greedy(PROMPTS[2], 12)


def test_bad_requests_and_a_full_queue(folder) -> None:
    generator = make_generator(folder)
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=64, max_queue=2)  # not started: nothing drains
    with pytest.raises(CapacityError, match="^the prompt .40 tokens. plus max_new_tokens .40. needs 79 positions; "
                                            "this server holds 64 per request$"):
        scheduler.submit(_request(list(range(3, 43)), 40))
    with pytest.raises(InputError, match="no prompts given"):
        scheduler.submit(_request([], 4))
    with pytest.raises(InputError, match=r"token id 99999, outside the vocabulary \[0, 300\)"):
        scheduler.submit(_request([5, 99999], 4))
    with pytest.raises(InputError, match="^max_new_tokens must be an integer >= 1, got 0$"):
        scheduler.submit(_request([5], 0))
    with pytest.raises(InputError, match="^the scheduler runs one prompt per request, got 2$"):
        scheduler.submit(_request([[5], [6]], 4))
    with pytest.raises(InputError, match="^the scheduler does not take capacity, keep_logits "):
        scheduler.submit(_request([5], 4, capacity=8, keep_logits=True))
    scheduler.submit(_request([5], 4))
    scheduler.submit(_request([6], 4))
    with pytest.raises(QueueFullError, match=r"^2 requests are already waiting \(max_queue 2\)$"):
        scheduler.submit(_request([7], 4))
    with pytest.raises(InputError, match="^max_seq_len must be between 2 and the export's 256, got 1000000000$"):
        Scheduler(generator, max_seq_len=10**9)
    with pytest.raises(InputError, match="^max_batch 4 exceeds what backend fake runs .2.$"):
        Scheduler(make_generator(folder, max_batch=2), max_batch=4)
    bare = LoadedExport(folder, backend=without_rows(generator.backend))
    with pytest.raises(BackendUnavailableError, match=r"^serving needs a backend with row operations .* has none$"):
        Scheduler(bare, max_batch=2, max_seq_len=64)
    scheduler.close()


def test_an_internal_error_in_one_row_ends_that_request_alone(recorded) -> None:
    model, scheduler, _ = recorded
    seen: list = []

    def consumer_that_breaks(event) -> None:
        seen.append(event)
        if isinstance(event, Delta) and len(seen) == 3:
            raise RuntimeError("the client's queue is gone")

    broken = scheduler.submit(_request(PROMPTS[0], 12), on_event=consumer_that_breaks)
    others = [scheduler.submit(_request(p, 12)) for p in PROMPTS[1:3]]
    scheduler.start()
    for handle, prompt in zip(others, PROMPTS[1:3], strict=True):
        tokens, _, done = handle.result()
        assert tokens == model.greedy(prompt, 12) and done.error is None
    done = [e for e in seen if isinstance(e, Done)]
    assert len(done) == 1 and done[0].finish_reason == FinishReason.ERROR
    assert done[0].error == "internal error delivering a token: RuntimeError: the client's queue is gone"
    assert broken.done is done[0]
    scheduler.prefixes.store = lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room"))
    tokens, _, done = scheduler.submit(_request(PROMPTS[3], 8)).result()
    assert tokens == model.greedy(PROMPTS[3], 8) and done.error is None
    assert (scheduler.snapshot()["prefix_store_errors"], scheduler.snapshot()["running"]) == (1, 0)


def test_a_backend_failure_ends_every_request_in_flight_not_the_server(recorded) -> None:
    model, scheduler, _ = recorded
    backend = scheduler.backend
    decode = backend.decode
    backend.decode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    handles = [scheduler.submit(_request(p, 8)) for p in PROMPTS[:2]]
    scheduler.start()
    for handle in handles:
        handle.result()
        assert (handle.done.finish_reason, handle.done.error) == (FinishReason.ERROR, "RuntimeError: device lost")
    backend.decode = decode
    assert scheduler.submit(_request(PROMPTS[2], 8)).result()[0] == model.greedy(PROMPTS[2], 8)


def test_speculation_alone_and_beside_other_requests(recorded) -> None:
    model, scheduler, _ = recorded
    spec = Speculation("prompt-lookup", 4)
    scheduler.start()
    for prompt in REPEATING:  # alone: every step verifies a draft where there is one
        assert scheduler.submit(_request(prompt, 40, speculation=spec)).result()[0] == model.greedy(prompt, 40)
    alone = scheduler.snapshot()
    assert 0 < alone["accepted_tokens"] <= alone["draft_tokens"]
    assert alone["decode_steps"] == 3 * 39 - alone["accepted_tokens"]  # each accepted token saved a step
    first = scheduler.submit(_request(REPEATING[0], 40, speculation=spec))
    late, deltas = [], 0
    for event in first:
        deltas += isinstance(event, Delta)
        if deltas > 3 and not late:
            late = [scheduler.submit(_request(REPEATING[1], 40)),
                    scheduler.submit(_request(REPEATING[2], 40, speculation=spec))]
    assert first.result()[0] == model.greedy(REPEATING[0], 40)
    assert [h.result()[0] for h in late] == [model.greedy(p, 40) for p in REPEATING[1:]]


def test_speculation_ending_inside_an_accepted_run_keeps_every_token(folder) -> None:
    generator = make_generator(folder, favour=0)  # greedy always 0: drafts accepted whole
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=128, prefill_chunk=8).start()
    try:
        for n in range(2, 16):
            fast = scheduler.submit(_request([1, 0, 0, 0], n, speculation=Speculation("prompt-lookup", 6)))
            queued = [scheduler.submit(_request([1, 5, 6], 3)) for _ in range(2)]
            tokens, _, done = fast.result()
            assert (tokens, done.completion_tokens, done.finish_reason) == ([0] * n, n, "length"), n
            for handle in queued:
                got, _, after = handle.result()
                assert (got, after.error, after.finish_reason) == ([0] * 3, None, "length"), n
        assert scheduler.snapshot()["accepted_tokens"] > 2 * len(range(2, 16))
    finally:
        scheduler.close()


def test_an_ort_target_scheduler_verifies_one_row_only(tmp_path) -> None:
    # The fake refuses what GroupQueryAttention cannot do (several rows extended after a past), so a
    # scheduler verifying beside other rows would fail here.
    generator = make_generator(write_export(tmp_path / "ort", target="ort"))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=4).start()
    try:
        spec = Speculation("prompt-lookup", 5)
        handles = [scheduler.submit(_request(p, 30, speculation=spec)) for p in REPEATING]
        model = generator.backend.model
        assert [h.result()[0] for h in handles] == [model.greedy(p, 30) for p in REPEATING]
    finally:
        scheduler.close()


def test_closing_a_scheduler_never_started_ends_what_waits(recorded) -> None:
    """No loop ever ran: close() itself ends each queued request (every choice) and scoring job, cancelled."""
    _, scheduler, _ = recorded
    handles = [scheduler.submit(_request(PROMPTS[0], 4)), scheduler.submit(GenerationRequest(PROMPTS[1], 4, SamplingConfig(seed=1), n=2))]
    scored = scheduler.score(PROMPTS[2])
    scheduler.close()
    message = "the scheduler was closed before it started"
    for handle in handles:
        assert handle.done is not None and sorted(handle.dones) == list(range(handle.request.n))
        assert all(d.finish_reason == FinishReason.CANCELLED and d.error == message for d in handle.dones.values())
    with pytest.raises(Exception, match=message):
        scored.result(timeout=1)
    with pytest.raises(Exception, match="the scheduler is closed"):
        scheduler.submit(_request(PROMPTS[0], 4))
