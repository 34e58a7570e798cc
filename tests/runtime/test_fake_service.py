"""GenerationService (runtime/service.py) on the fake backend (tests/fake_backend.py): prompts checked
against the context, chat conversations rendered in the template's child process, requests queued all or
none, answers equal to the fake model's own greedy loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from fake_backend import make_generator, write_export
from shared_exports import CHAT_TEMPLATE

from kvforge.core.errors import CapacityError, InputError
from kvforge.runtime.controls.constraint import Grammar
from kvforge.runtime.drivers.scheduler import Done
from kvforge.runtime.service import GenerationService


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenerationService]:
    folder = write_export(tmp_path_factory.mktemp("fake") / "export", chat_template=CHAT_TEMPLATE)
    service = GenerationService(make_generator(folder), max_batch=2, max_seq_len=128, prefill_chunk=8)
    yield service
    service.close()


def _answer(service: GenerationService, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of one request through service.submit (its events come to the callback)."""
    events: list = []
    ended = threading.Event()

    def on_event(position: int, event) -> None:
        events.append(event)
        if isinstance(event, Done):
            ended.set()

    service.submit([service.request(ids, n, greedy=True, ignore_eos=True)], on_event)
    assert ended.wait(30)
    assert events[-1].finish_reason == "length", events[-1]
    return [t for event in events[:-1] for t in event.token_ids]


def test_a_text_prompt_is_answered_like_the_model(service) -> None:
    model = service.export.backend.model
    ids = service.encode("Once upon a time", special=True)
    assert ids == service.tokenizer.encode("Once upon a time") and ids[0] == 1
    assert _answer(service, ids, 12) == model.greedy(ids, 12)


def test_a_conversation_is_rendered_by_the_template_and_answered(service) -> None:
    model = service.export.backend.model
    messages = [{"role": "user", "content": "Hello, world!"}]
    ids = service.conversation(messages, None)
    assert service.decode(ids) == "user: Hello, world!\nassistant:"
    assert _answer(service, ids, 10) == model.greedy(ids, 10)
    with pytest.raises(InputError, match=r"^messages\[0\]\.name is not written by this model's chat template"):
        service.conversation([{"role": "user", "content": "hi", "name": "bob"}], None)


def test_prompts_that_cannot_fit_or_are_not_in_the_vocabulary(service) -> None:
    with pytest.raises(CapacityError, match=r"^the prompt \(129 tokens\) does not fit this server's context of 128 "
                                            r"tokens; shorten it$"):
        service.check_length([5] * 129)
    chars = service.max_prompt_chars + 1
    with pytest.raises(CapacityError, match=rf"^the prompt \({chars} characters\) does not fit this server's context"):
        service.encode("a" * chars, special=False)
    with pytest.raises(InputError, match=r"^the prompt's position 1 has token id 300, outside the vocabulary "
                                         r"\[0, 300\)$"):
        service.check_ids([5, 300])
    with pytest.raises(InputError, match="^the regex grammar cannot be compiled: "):
        service.check_grammar(Grammar.regex("(unclosed"))


def test_requests_are_queued_all_or_none(service) -> None:
    model = service.export.backend.model
    good = service.request([1, 2, 3], 100, greedy=True, ignore_eos=True)
    with pytest.raises(InputError, match="^max_new_tokens must be an integer >= 1, got 0$"):
        service.request([4, 5], 0)
    too_long = service.request(list(range(3, 103)), 40, greedy=True)
    events: list = []
    ended = threading.Event()

    def on_event(position: int, event) -> None:
        events.append((position, event))
        if isinstance(event, Done):
            ended.set()

    with pytest.raises(CapacityError, match="needs 139 positions; this server holds 128 per request$"):
        service.submit([good, None, too_long], on_event)
    # The good request, queued first, was cancelled with the batch (the scheduler may have started it).
    assert ended.wait(30)
    position, done = events[-1]
    assert position == 0 and done.finish_reason == "cancelled" and done.completion_tokens < 100
    assert _answer(service, [1, 2, 3], 6) == model.greedy([1, 2, 3], 6)


def test_a_service_without_a_template_refuses_conversations(tmp_path) -> None:
    service = GenerationService(make_generator(write_export(tmp_path / "plain")), max_batch=1, max_seq_len=64)
    try:
        assert service.renderer is None
        with pytest.raises(InputError, match="has no chat template .* use a plain prompt instead$"):
            service.conversation([{"role": "user", "content": "hi"}], None)
    finally:
        service.close()


def test_prompt_logprobs_are_a_job_of_the_scheduler_thread(service) -> None:
    # Echo with logprobs: the scheduler's thread scores the prompt (its staging cache, its max_seq_len), so in
    # serving only that thread touches the backend. The values equal a plain log_softmax of the fake model's
    # own logits at each position, and the Generator's prompt_logprobs.
    import numpy as np

    from kvforge.runtime import Generator

    backend = service.export.backend
    threads: list[str] = []
    prefill = backend.prefill

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return prefill(*args, **kwargs)

    backend.prefill = recording
    try:
        ids = [1, 17, 42, 9, 250, 3]
        got = service.prompt_logprobs(ids, 3)
    finally:
        del backend.prefill
    assert threads == ["kvforge-scheduler"]
    assert got[0] is None and len(got) == len(ids)
    every = np.asarray(backend.model.logits(ids), np.float64)  # row t predicts the token after ids[:t + 1]
    for position, entry in enumerate(got[1:], start=1):
        logits = every[position - 1]
        want = logits - (np.log(np.exp(logits - logits.max()).sum()) + logits.max())
        assert entry.token == ids[position] and entry.logprob == pytest.approx(want[ids[position]], abs=1e-5)
        assert [token for token, _ in entry.top] == list(np.argsort(-want, kind="stable")[:3])
    alone = Generator(service.export).prompt_logprobs(ids, 3)
    assert alone == got
    assert service.prompt_logprobs([7], 0) == [None]
    with pytest.raises(CapacityError, match="^the prompt .129 tokens. needs 129 positions; this server holds 128"):
        service.prompt_logprobs([5] * 129, 0)
    with pytest.raises(InputError, match=r"^top must be an integer in 0\.\.20, got 21$"):
        service.prompt_logprobs(ids, 21)
