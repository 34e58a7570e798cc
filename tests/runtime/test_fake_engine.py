"""The Generator and its StepEngine on the fake backend (tests/fake_backend.py): greedy batches of different
lengths, stops, capacity limits, speculation, slot reuse and row moves, each against the fake model's
own token-by-token reference loop (FakeModel.greedy / .logits), which never touches the runtime."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from fake_backend import make_generator, write_export

from kvforge.core.errors import CapacityError, InputError, NumericalError
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.controls.request import Stopper
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.engine import StepEngine
from kvforge.runtime.drivers.rows import Picker, Row

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 250, 12, 12, 8, 90], [1, 2, 3]]
# Prompts that repeat themselves, so prompt lookup drafts from the first step.
REPEATING = [[1, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70], [1, 7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_export(tmp_path_factory.mktemp("fake") / "export")


@pytest.fixture
def generator(folder: Path) -> Generator:
    return make_generator(folder)


def test_the_reference_tells_prompts_apart(generator) -> None:
    # Different prompts continue differently, so every comparison with the reference below can fail.
    model = generator.backend.model
    continuations = {tuple(model.greedy(p, 12)) for p in PROMPTS}
    assert len(continuations) == len(PROMPTS)


def test_a_batch_of_different_lengths_gives_each_prompts_reference(generator) -> None:
    model = generator.backend.model
    result = generator.generate(PROMPTS, max_new_tokens=24, greedy=True, ignore_eos=True)
    assert result.tokens == [model.greedy(p, 24) for p in PROMPTS]
    assert result.finish_reason == ["length"] * 4 and result.prompt_tokens == [5, 21, 6, 3]
    # One right-padded prefill of the whole batch, then one decode step per further token.
    assert generator.runs == {"prefill": 1, "decode": 23} and result.steps == 23
    assert generator.backend.calls[0] == ("prefill", 4, 21)


def test_kept_logits_are_the_models_logits_bit_for_bit(generator) -> None:
    model = generator.backend.model
    result = generator.generate(PROMPTS[:2], max_new_tokens=6, greedy=True, ignore_eos=True, keep_logits=True)
    assert len(result.logits) == 6
    for b, prompt in enumerate(PROMPTS[:2]):
        for step in range(6):
            want = model.logits(prompt + result.tokens[b][:step])[-1]
            assert np.array_equal(result.logits[step][b], want), (b, step)


def test_stop_tokens_eos_and_ignore_eos(generator, tmp_path) -> None:
    model = generator.backend.model
    want = model.greedy(PROMPTS[0], 20)
    stop = want[7]
    result = generator.generate(PROMPTS[:2], max_new_tokens=20, greedy=True, ignore_eos=True, stop_token_ids=[stop])
    assert result.tokens[0] == want[: want.index(stop) + 1] and result.finish_reason[0] == "stop"
    assert result.tokens[1] == model.greedy(PROMPTS[1], 20, stop={stop})
    # The same token as the export's EOS: "eos", unless ignore_eos.
    eos = make_generator(write_export(tmp_path / "eos", eos=(stop,)))
    result = eos.generate([PROMPTS[0]], max_new_tokens=20, greedy=True)
    assert (result.tokens[0], result.finish_reason) == (want[: want.index(stop) + 1], ["eos"])
    assert eos.generate([PROMPTS[0]], max_new_tokens=20, greedy=True, ignore_eos=True).tokens[0] == want


def test_text_prompts_and_stop_strings(generator) -> None:
    model, tokenizer = generator.backend.model, generator.tokenizer
    ids = tokenizer.encode("Once upon a time")
    assert ids[0] == 1  # the tokenizer's <s>
    want = model.greedy(ids, 30)
    text = generator.generate("Once upon a time", max_new_tokens=30, greedy=True, ignore_eos=True).text[0]
    assert text == tokenizer.decode(want)
    stop = text[12:14]
    result = generator.generate("Once upon a time", max_new_tokens=30, greedy=True, ignore_eos=True, stop=[stop])
    assert result.text == [text[: text.index(stop)]] and result.finish_reason == ["stop"]


def test_score_and_prompt_logprobs_are_the_models_log_softmax(generator) -> None:
    ids = PROMPTS[1]
    logits = generator.backend.model.logits(ids)[:-1].astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    want = logits[np.arange(len(ids) - 1), ids[1:]] - (np.log(np.exp(logits - peak).sum(-1)) + peak[:, 0])
    assert np.allclose(generator.score(ids), want, rtol=0, atol=1e-9)
    scored = generator.prompt_logprobs(ids, top=3)
    assert scored[0] is None and len(scored) == len(ids)
    assert [t for t, _ in scored[1].top] == np.argsort(-logits[0])[:3].tolist()


def test_capacity_limits_and_their_messages(folder, generator) -> None:
    with pytest.raises(CapacityError, match=r"^the request needs 299 positions \(longest prompt \+ max_new_tokens - 1\) "
                                            r"but the export allows at most 256; shorten the prompt or lower max_new_tokens$"):
        generator.generate([list(range(3, 203))], max_new_tokens=100)
    with pytest.raises(CapacityError, match=r"^the request needs 14 positions but the KV cache holds 10; "
                                            r"raise capacity \(max 256\)$"):
        generator.generate([PROMPTS[0]], max_new_tokens=10, capacity=10)
    with pytest.raises(CapacityError, match="^capacity 300 exceeds the export's max_capacity 256; pass at most 256$"):
        generator.generate([PROMPTS[0]], max_new_tokens=10, capacity=300)
    small = make_generator(folder, max_batch=2)
    with pytest.raises(CapacityError, match=r"^4 prompts, but backend 'fake' runs at most 2 rows at once "):
        small.generate(PROMPTS)


def test_a_cache_filled_to_its_exact_capacity(generator) -> None:
    # 5 prompt tokens + 60 new - 1 = 64 positions: the last decode step writes the cache's last position.
    result = generator.generate([PROMPTS[0]], max_new_tokens=60, greedy=True, ignore_eos=True, capacity=64)
    assert result.tokens[0] == generator.backend.model.greedy(PROMPTS[0], 60)
    assert generator.cache.capacity == 64 and int(generator.cache.past_lens[0]) == 64


def test_the_backend_checks_capacity_for_running_rows_only(generator) -> None:
    backend = generator.backend
    slot = backend.allocate(2, 64)
    slot.cache.past_lens[:] = [63, 64]
    with pytest.raises(CapacityError, match=r"^this step needs 65 positions but the KV cache holds 64; raise capacity "
                                            r"\(max 256\)$"):
        backend.prefill(slot, np.zeros((2, 1), np.int64), np.zeros(2, np.int64))
    with pytest.raises(CapacityError, match="this step needs 65 positions"):
        backend.decode(slot, np.zeros(2, np.int64))
    slot.cache.past_lens[:] = 0  # row 1 full and frozen: a decode step of row 0 alone is fine
    backend.prefill(slot, np.array([[3], [4]]), np.zeros(2, np.int64))
    slot.cache.past_lens[:] = [1, 64]
    backend.decode(slot, np.array([5, 0]), np.array([True, False]))


def test_speculation_gives_plain_greedy_tokens_with_fewer_steps(generator) -> None:
    model = generator.backend.model
    accepted = 0
    for prompt in REPEATING:
        fast = generator.generate([prompt], max_new_tokens=40, ignore_eos=True, speculate="prompt-lookup")
        assert fast.tokens == [model.greedy(prompt, 40)]
        assert fast.steps == 39 - fast.accepted_tokens and fast.draft_tokens >= fast.accepted_tokens
        accepted += fast.accepted_tokens
    assert accepted > 0  # drafts were accepted: verification really kept several tokens per step
    before = generator.runs
    fast = generator.generate(REPEATING, max_new_tokens=40, ignore_eos=True, speculate="prompt-lookup", draft_len=5)
    assert fast.tokens == [model.greedy(p, 40) for p in REPEATING]
    runs = {phase: generator.runs[phase] - before[phase] for phase in ("prefill", "decode")}
    assert runs["prefill"] + runs["decode"] == 1 + fast.steps and runs["prefill"] > 1


def test_speculation_stopping_inside_an_accepted_run(generator) -> None:
    model = generator.backend.model
    stop = model.greedy(REPEATING[0], 40)[25]
    # A stop token from the middle of row 0's output ends each row that emits it there, drafts or not.
    want = [model.greedy(p, 40, stop={stop}) for p in REPEATING]
    stream = generator.stream(REPEATING, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop],
                              speculate="prompt-lookup", draft_len=7)
    streamed: list[list[int]] = [[] for _ in REPEATING]
    for event in stream:
        for b, token in enumerate(event.token_ids):
            if token is not None:
                streamed[b].append(token)
    assert streamed == stream.result.tokens == want
    assert stream.result.finish_reason == ["stop" if tokens[-1] == stop else "length" for tokens in want]
    assert stream.result.finish_reason[0] == "stop" and len(want[0]) < 40


def test_speculation_on_a_model_that_always_repeats(folder) -> None:
    # Every draft of zeros is accepted whole: max_new_tokens is reached inside a run of several tokens.
    generator = make_generator(folder, favour=0)
    for n in range(2, 14):
        result = generator.generate([[1, 0, 0, 0]], max_new_tokens=n, ignore_eos=True, speculate="prompt-lookup")
        assert (result.tokens, result.finish_reason) == ([[0] * n], ["length"]), n
    assert result.accepted_tokens > 1 and result.steps < 12


def test_speculation_refusals(folder, tmp_path) -> None:
    ort = make_generator(write_export(tmp_path / "ort", target="ort"))
    with pytest.raises(InputError, match=r"^speculative decoding of 3 prompts at once is not possible on this export: "
                                         r"its 'ort' target verifies drafts for at most 1 row\(s\) per call "):
        ort.generate(REPEATING, speculate="prompt-lookup")
    assert ort.generate([REPEATING[0]], max_new_tokens=9, speculate="prompt-lookup").tokens
    recurrent = make_generator(folder, rollback=False)
    with pytest.raises(InputError, match="^speculative decoding needs a cache that can drop rejected drafts"):
        recurrent.generate([REPEATING[0]], speculate="prompt-lookup")
    with pytest.raises(InputError, match=r"^draft_len must be an integer in 1\.\.15, got 0$"):
        ort.generate([REPEATING[0]], speculate="prompt-lookup", draft_len=0)
    with pytest.raises(InputError, match="unknown speculation method 'medusa'; choose one of prompt-lookup"):
        ort.generate([REPEATING[0]], speculate="medusa")
    with pytest.raises(InputError, match=r"^speculate='draft' needs a draft export: Generator\(export, draft=DIR\)"):
        ort.generate([REPEATING[0]], speculate="draft")
    with pytest.raises(InputError, match="keep_logits is not available"):
        ort.generate([REPEATING[0]], speculate="prompt-lookup", keep_logits=True)


def test_slots_are_reused_and_stale_rows_never_read(generator) -> None:
    model = generator.backend.model
    generator.generate(PROMPTS[:2], max_new_tokens=8, greedy=True, ignore_eos=True)
    allocations = generator.backend.allocations
    # The same shape again: the idle slot, still holding the previous request's rows.
    swapped = [PROMPTS[3], PROMPTS[2]]
    assert generator.generate(swapped, max_new_tokens=8, greedy=True, ignore_eos=True).tokens == \
        [model.greedy(p, 8) for p in swapped]
    assert generator.backend.allocations == allocations


def test_threads_on_one_generator_get_their_own_slots(generator) -> None:
    model = generator.backend.model
    want = {i: model.greedy(p, 10) for i, p in enumerate(PROMPTS)}
    got: dict[tuple[int, int], list[int]] = {}

    def run(worker: int) -> None:
        for k in range(4):
            i = (worker + k) % len(PROMPTS)
            got[worker, k] = generator.generate([PROMPTS[i]], max_new_tokens=10, greedy=True, ignore_eos=True).tokens[0]

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == {(w, k): want[(w + k) % len(PROMPTS)] for w in range(4) for k in range(4)}


def _engine(generator, batch: int) -> StepEngine:
    slot = generator.backend.allocate(batch, 64)
    return StepEngine(generator.backend, slot, generator.pad_token_id, generator.check_logits)


def _row(prompt: list[int], n: int) -> Row:
    return Row(prompt, Stopper(GenerationRequest(prompt, n, ignore_eos=True), frozenset(), None))


def _run(engine: StepEngine) -> None:
    while engine.any_running():
        engine.decode()


def test_engine_compact_and_admit_move_rows_through_the_backend(generator) -> None:
    model, picker = generator.backend.model, Picker(SamplingConfig(greedy=True))
    engine = _engine(generator, 3)
    rows = [_row(p, n) for p, n in zip(PROMPTS[:3], (3, 12, 12), strict=True)]
    for at, row in enumerate(rows):
        engine.place(at, row, picker)
    engine.prefill(PROMPTS[:3])
    _ = [engine.decode() for _ in range(2)]
    assert rows[0].finished
    engine.release(0)
    assert engine.compact() == [(2, 0)]  # the last row moved into the hole, its positions with it
    # A prompt prefilled alone on a one-row slot joins at the free row 2.
    stage = generator.backend.allocate(1, 64)
    logits = generator.backend.prefill(stage, np.array([PROMPTS[3]]), np.array([2]))
    late = _row(PROMPTS[3], 5)
    engine.admit([(2, late, picker)], stage, 3, logits[0])
    _run(engine)
    assert [r.tokens for r in (rows[0], rows[1], rows[2], late)] == [
        model.greedy(PROMPTS[0], 3), model.greedy(PROMPTS[1], 12), model.greedy(PROMPTS[2], 12),
        model.greedy(PROMPTS[3], 5)]


def test_reading_a_position_never_written_is_a_numerical_error(generator) -> None:
    engine = _engine(generator, 1)
    engine.place(0, _row(PROMPTS[0], 8), Picker(SamplingConfig(greedy=True)))
    engine.prefill([PROMPTS[0]])
    engine.cache.past_lens[0] += 3  # a bookkeeping slip: the step would attend three unwritten positions
    with pytest.raises(NumericalError, match="^the model produced NaN logits at step 1; the export may be corrupted"):
        engine.decode()


def test_row_operations_and_their_errors(generator) -> None:
    backend = generator.backend
    slot, other = backend.allocate(2, 64), backend.allocate(1, 64)
    backend.prefill(slot, np.array([PROMPTS[0], PROMPTS[2][:5]]), np.array([4, 4]))
    rows = backend.read_rows(slot, 1, 5)
    assert [a.shape for a in rows[0]] == [(1, 5, 8), (1, 5, 8)] and len(rows) == 2
    backend.write_rows(other, 0, rows, 5)
    assert all(np.array_equal(a, b) for x, y in zip(backend.read_rows(other, 0, 5), rows, strict=True)
               for a, b in zip(x, y, strict=True))
    backend.copy_rows(slot, 0, slot, 1, 5)
    assert np.array_equal(backend.read_rows(slot, 1, 5)[1][0], backend.read_rows(slot, 0, 5)[1][0])
    view = backend.view_rows(slot, 1)
    assert view.cache.batch == 1 and np.shares_memory(view.cache.layers[0][0], slot.cache.layers[0][0])
    view.cache.past_lens[0] = 9
    assert slot.cache.past_lens[0] == 9
    with pytest.raises(InputError, match="^row 2 is outside the cache's 2 rows$"):
        backend.read_rows(slot, 2, 5)
    with pytest.raises(CapacityError, match="^65 positions do not fit the cache's capacity 64$"):
        backend.copy_rows(slot, 0, other, 0, 65)
    with pytest.raises(InputError, match=r"^rows of shape \(1, 3, 8\) do not fit layer 0's key cache"):
        backend.write_rows(other, 0, [(a[:, :3], b) for a, b in rows], 5)
