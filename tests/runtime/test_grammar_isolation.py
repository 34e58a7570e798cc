"""One request's grammar failing mid-generation ends that request alone (runtime/drivers/rows.py Row.fail):
the other rows of the batch, other requests', still give their solo greedy answers, in the Scheduler
and through the server (a 400 for the failing client, streamed or not). Found by a hostile probe: a
regex that compiled but failed at its first step ended every running request with a 500."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from serving import late_failing_grammar

from kvforge.core.errors import GrammarError
from kvforge.runtime import FinishReason, GenerationRequest, Generator
from kvforge.runtime.controls.constraint import Grammar
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Scheduler

GOOD = ["The quick brown fox", "Once upon a time", "hello there"]
FAILING = "A list:"


@pytest.fixture(scope="module")
def generator(exported):
    return Generator(exported("llama-tiny", "ort"))


def _solo(generator: Generator, prompt: str, n: int) -> list[int]:
    return generator.generate(prompt, max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]


class _FailsOnApply:
    """A grammar matcher whose mask fails at its third step (the pick path: the row takes no token)."""

    def __init__(self) -> None:
        self.steps = 0

    def apply(self, row: np.ndarray) -> None:
        self.steps += 1
        if self.steps == 3:
            raise GrammarError("the grammar failed: stand-in mask failure")

    def advance(self, token: int) -> None:
        pass


def test_a_failing_grammar_ends_its_request_alone_in_the_scheduler(generator, monkeypatch) -> None:
    lark = late_failing_grammar(generator, FAILING)
    stand_in = Grammar.regex("[a-z]+")
    real_matcher = generator.export.grammar_matcher
    monkeypatch.setattr(generator.export, "grammar_matcher",
                        lambda grammar: _FailsOnApply() if grammar == stand_in else real_matcher(grammar))
    want = [_solo(generator, p, 16) for p in GOOD]
    scheduler = Scheduler(generator, max_batch=8, max_seq_len=128, prefill_chunk=8)
    ids = [generator.tokenizer.encode(p) for p in GOOD]
    good = [scheduler.submit(GenerationRequest(i, 16, SamplingConfig(greedy=True), ignore_eos=True)) for i in ids]
    failing = [scheduler.submit(GenerationRequest(generator.tokenizer.encode(FAILING), 16, SamplingConfig(greedy=True),
                                                  grammar=g)) for g in (Grammar.lark(lark), stand_in)]
    scheduler.start()  # submitted first: all five are in the batch together when the grammars fail
    try:
        for handle, tokens in zip(good, want, strict=True):
            assert handle.result()[0] == tokens
            assert handle.done.finish_reason == FinishReason.LENGTH
        for handle, message in zip(failing, ("too many expressions", "stand-in mask failure"), strict=True):
            handle.result()
            done = handle.done
            assert done.finish_reason == FinishReason.ERROR and done.client_error, done
            assert message in done.error and len(done.error) < 400, done.error
        assert failing[1].done.completion_tokens == 2  # two tokens, then the mask of the third failed
        # The server is still whole: the next request runs.
        again = scheduler.submit(GenerationRequest(ids[0], 16, SamplingConfig(greedy=True), ignore_eos=True))
        assert again.result()[0] == want[0]
    finally:
        scheduler.close()


def test_the_server_answers_the_failing_client_400_and_the_others_their_answers(generator, exported) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serving import serving

    from kvforge.serve.app import create_app

    lark = late_failing_grammar(generator, FAILING)
    app = create_app(exported("llama-tiny", "ort"), max_batch=8, max_seq_len=256, model_name="tiny", prefill_chunk=16)
    want = {p: generator.generate(p, max_new_tokens=40, greedy=True, ignore_eos=True).text[0] for p in GOOD}
    with serving(app) as base:
        answers: dict[str, object] = {}

        def good(prompt: str) -> None:
            answers[prompt] = httpx.post(f"{base}/v1/completions", json={
                "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}, timeout=60).json()

        threads = [threading.Thread(target=good, args=(p,)) for p in GOOD]
        for thread in threads:
            thread.start()
        body = {"prompt": FAILING, "max_tokens": 16, "temperature": 0,
                "response_format": {"type": "lark", "grammar": lark}}
        failed = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=60)
        for thread in threads:
            thread.join()
        assert failed.status_code == 400, failed.text
        error = failed.json()["error"]
        assert error["code"] == "grammar_failed" and "too many expressions" in error["message"], error
        assert len(failed.content) < 1000  # no parser-state dump
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and '"code": "grammar_failed"' in events[-2] and events[-1] == "data: [DONE]"
        for prompt in GOOD:
            assert answers[prompt]["choices"][0]["text"] == want[prompt], answers[prompt]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
