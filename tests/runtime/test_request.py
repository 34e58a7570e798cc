"""The request type shared by Generator, Scheduler, CLI and server (runtime/controls/request.py): keywords
resolved in one place, validation, one finish-reason vocabulary, and the stop handling both the
Generator's loop and the Scheduler use."""

from __future__ import annotations

import json

import pytest

from kvforge.core.errors import InputError
from kvforge.runtime import FinishReason, GenerationRequest, Generator, SamplingConfig, Speculation
from kvforge.runtime.controls.request import Stopper, openai_finish_reason
from kvforge.runtime.drivers.scheduler import Scheduler


def test_create_resolves_sampling_keywords_against_the_defaults() -> None:
    defaults = SamplingConfig(greedy=False, temperature=0.8, top_k=40)
    assert GenerationRequest.create("hi", defaults=defaults).sampling == defaults
    assert GenerationRequest.create("hi", greedy=True, defaults=defaults).sampling.greedy
    sampled = GenerationRequest.create("hi", top_p=0.9, seed=3)  # a filter without `greedy` means sampling
    assert sampled.sampling == SamplingConfig(greedy=False, top_p=0.9, seed=3)
    with pytest.raises(InputError, match="not both"):
        GenerationRequest.create("hi", sampling=SamplingConfig(), top_k=3)
    request = GenerationRequest.create([1, 2], 5, stop_token_ids=[7, 7, 8], stop="\n", speculate="prompt-lookup",
                                       draft_len=4)
    assert request.stop_token_ids == frozenset({7, 8}) and request.stop == ("\n",)
    assert request.speculation == Speculation("prompt-lookup", 4)
    assert request.replace(max_new_tokens=9).max_new_tokens == 9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be an integer or a list of integers"),
        ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
        ({"speculate": "medusa"}, "unknown speculation method"),
        ({"speculate": "prompt-lookup", "greedy": True, "keep_logits": True}, "keep_logits is not available"),
    ],
)
def test_bad_requests_are_refused_where_they_are_built(kwargs, message) -> None:
    with pytest.raises(InputError, match=message):
        GenerationRequest.create("hi", **kwargs)


def test_finish_reasons_are_strings_and_map_to_openai() -> None:
    assert FinishReason.EOS == "eos" and str(FinishReason.LENGTH) == "length" and f"{FinishReason.STOP}" == "stop"
    assert json.dumps([FinishReason.CANCELLED]) == '["cancelled"]' and repr([FinishReason.EOS]) == "['eos']"
    assert {reason.value: openai_finish_reason(reason) for reason in FinishReason} == {
        "eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


class _Chars:
    """A detokenizer whose token t is the character chr(t)."""

    def add(self, token: int) -> str:
        return chr(token)

    def flush(self) -> str:
        return ""


def _feed(stopper: Stopper, text: str) -> list[str]:
    deltas = []
    for char in text:
        deltas.append(stopper.add(ord(char)))
        if stopper.reason is not None:
            break
    return deltas


def test_stopper_holds_back_a_possible_stop_string_and_cuts_before_it() -> None:
    stopper = Stopper(GenerationRequest("x", 50, stop=("END",)), frozenset(), _Chars())
    deltas = _feed(stopper, "abcENxENDzzz")
    assert stopper.reason == FinishReason.STOP and stopper.text == "abcENx" == "".join(deltas)
    assert deltas[:3] == ["", "", "a"]  # the last len("END") - 1 characters wait: they might start "END"

    eos = Stopper(GenerationRequest("x", 50), frozenset({ord("!")}), _Chars())
    _feed(eos, "hi!more")
    assert eos.reason == FinishReason.EOS and eos.generated == 3
    ignored = Stopper(GenerationRequest("x", 4, ignore_eos=True, stop_token_ids=frozenset({ord("?")})),
                      frozenset({ord("!")}), _Chars())
    _feed(ignored, "!!!!!")
    assert ignored.reason == FinishReason.LENGTH and ignored.generated == 4
    stop_id = Stopper(GenerationRequest("x", 9, stop_token_ids=frozenset({ord("?")})), frozenset(), None)
    assert _feed(stop_id, "ab?c") == ["", "", ""] and stop_id.reason == FinishReason.STOP


def test_generator_and_scheduler_stop_at_the_same_string(exported) -> None:
    generator = Generator(exported("llama-tiny", "ort"))
    full = generator.generate([5, 17, 99, 3, 42], max_new_tokens=20, greedy=True, ignore_eos=True)
    text = generator.tokenizer.decode(full.tokens[0])
    stop = text[len(text) // 2: len(text) // 2 + 3]
    request = generator.request([5, 17, 99, 3, 42], 20, greedy=True, ignore_eos=True, stop=[stop])
    result = generator.generate(request)
    assert result.text is None and result.finish_reason == [FinishReason.STOP]  # token-id prompt: no text out
    assert result.tokens[0] == full.tokens[0][: len(result.tokens[0])]
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=64).start()
    try:
        tokens, got, done = scheduler.submit(request).result()
    finally:
        scheduler.close()
    assert got == text[: text.index(stop)] and done.finish_reason == FinishReason.STOP
    assert tokens == result.tokens[0]
    with pytest.raises(InputError, match="pass either a GenerationRequest or prompts with options"):
        generator.generate(request, max_new_tokens=3)
    with pytest.raises(InputError, match="use chat_stream"):
        generator.chat("hi", stream=True)
