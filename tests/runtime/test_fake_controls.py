"""What a row picks with, on the fake backend (tests/fake_backend.py): llguidance grammars, penalties,
log-probabilities and n choices, in the Generator and inside one Scheduler batch, each against a reference
loop over the fake model's own logits (FakeModel.logits) that does not run the engine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest
from fake_backend import EOS_ID, make_generator, write_export
from serving import late_failing_grammar

from kvforge.core.errors import GrammarError, InputError
from kvforge.runtime import FinishReason, GenerationRequest, Generator
from kvforge.runtime.controls.constraint import Grammar, compiler_for
from kvforge.runtime.drivers.scheduler import Done, Scheduler

PROMPT = [1, 40, 41, 42, 43]
OTHERS = [[1, 90, 91], [1, 7, 8, 9, 10, 11, 12]]
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["tag", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Generator, Scheduler]]:
    generator = make_generator(write_export(tmp_path_factory.mktemp("fake") / "export"))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=4).start()
    yield generator, scheduler
    scheduler.close()


def _masked_greedy(generator, grammar: Grammar, prompt: list[int], n: int) -> list[int]:
    """Greedy over the model's logits masked by a fresh matcher of `grammar`, ending at EOS."""
    model = generator.backend.model
    matcher = compiler_for(generator.vocabulary).compile(grammar).matcher()
    out: list[int] = []
    while len(out) < n:
        logits = model.logits(prompt + out)[-1].copy()
        matcher.apply(logits)
        out.append(int(np.argmax(logits)))
        if out[-1] == EOS_ID:
            break
        matcher.advance(out[-1])
    return out


@pytest.mark.parametrize("grammar", [Grammar.regex(r"[a-z]{2,5}-[0-9]{1,3}"), Grammar.json_schema(SCHEMA)],
                         ids=["regex", "json_schema"])
def test_a_grammar_gives_the_masked_reference_and_text_it_accepts(served, grammar) -> None:
    generator, scheduler = served
    want = _masked_greedy(generator, grammar, PROMPT, 60)
    assert want[-1] == EOS_ID  # the grammar completed, then only EOS was allowed
    result = generator.generate([PROMPT], max_new_tokens=60, greedy=True, grammar=grammar)
    assert result.tokens[0] == want and result.finish_reason == ["eos"]
    text = generator.tokenizer.decode(want)
    if grammar.kind == "regex":
        assert re.fullmatch(grammar.source, text), text
    else:
        value = json.loads(text)
        assert value["tag"] in ("red", "green", "blue") and 0 <= value["n"] <= 99, text
    # In the scheduler, beside two plain requests that share its batch.
    handles = [scheduler.submit(GenerationRequest.create(PROMPT, 60, greedy=True, grammar=grammar))]
    handles += [scheduler.submit(GenerationRequest.create(p, 10, greedy=True, ignore_eos=True)) for p in OTHERS]
    assert handles[0].result()[0] == want and handles[0].done.finish_reason == "eos"
    model = generator.backend.model
    assert [h.result()[0] for h in handles[1:]] == [model.greedy(p, 10) for p in OTHERS]


def test_a_failing_grammar_ends_its_request_alone(served) -> None:
    generator, scheduler = served
    model = generator.backend.model
    prompt = "A list:"
    lark = Grammar.lark(late_failing_grammar(generator, prompt))
    with pytest.raises(GrammarError, match="^the grammar failed.*too many expressions"):
        generator.generate(prompt, max_new_tokens=16, greedy=True, grammar=lark)
    good = [scheduler.submit(GenerationRequest.create(p, 16, greedy=True, ignore_eos=True)) for p in OTHERS]
    failing = scheduler.submit(GenerationRequest.create(generator.tokenizer.encode(prompt), 16, greedy=True,
                                                        grammar=lark))
    failing.result()
    done = failing.done
    assert done.finish_reason == FinishReason.ERROR and done.client_error and "too many expressions" in done.error
    assert [h.result()[0] for h in good] == [model.greedy(p, 16) for p in OTHERS]


def test_a_grammar_without_a_matcher_is_refused(served) -> None:
    generator, scheduler = served
    with pytest.raises(InputError, match=r"^constrained decoding needs a grammar spec .* got dict$"):
        generator.stream([PROMPT], max_new_tokens=2, grammar={"type": "json"})
    with pytest.raises(InputError, match=r"^constrained decoding needs a grammar spec .* got str$"):
        scheduler.submit(GenerationRequest.create(PROMPT, 2, grammar="x"))


def _penalized_greedy(model, prompt: list[int], n: int, repetition: float, presence: float,
                      frequency: float) -> list[int]:
    """Greedy with HF's repetition penalty (prompt and output) and OpenAI's presence / frequency (output)."""
    out: list[int] = []
    for _ in range(n):
        logits = model.logits(prompt + out)[-1].astype(np.float64)
        seen = sorted(set(prompt + out))
        logits[seen] = np.where(logits[seen] < 0, logits[seen] * repetition, logits[seen] / repetition)
        counts = np.bincount(out, minlength=len(logits)).astype(np.float64)
        logits -= frequency * counts + presence * (counts > 0)
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("penalties", [{"repetition_penalty": 3.0}, {"presence_penalty": 2.0, "frequency_penalty": 1.5},
                                       {"repetition_penalty": 0.5, "frequency_penalty": -1.0}])
def test_penalties_pick_what_a_reference_picks(served, penalties: dict) -> None:
    generator, scheduler = served
    model = generator.backend.model
    prompt = [1, 2, 3]  # its plain continuation cycles, so the penalties change it
    args = (penalties.get("repetition_penalty", 1.0), penalties.get("presence_penalty", 0.0),
            penalties.get("frequency_penalty", 0.0))
    want = _penalized_greedy(model, prompt, 20, *args)
    assert want != model.greedy(prompt, 20)
    assert generator.generate([prompt], max_new_tokens=20, greedy=True, ignore_eos=True, **penalties).tokens[0] == want
    handle = scheduler.submit(GenerationRequest.create(prompt, 20, greedy=True, ignore_eos=True, **penalties))
    assert handle.result()[0] == want


def test_logprobs_are_the_models_log_softmax(served) -> None:
    generator, scheduler = served
    model = generator.backend.model
    result = generator.generate([PROMPT], max_new_tokens=6, greedy=True, ignore_eos=True, logprobs=2)
    tokens = result.tokens[0]
    for step, got in enumerate(result.logprobs[0]):
        logits = model.logits(PROMPT + tokens[:step])[-1].astype(np.float64)
        logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert got.token == tokens[step] and got.logprob == pytest.approx(logp[tokens[step]], abs=1e-9)
        assert [t for t, _ in got.top] == np.argsort(-logp, kind="stable")[:2].tolist()
    handle = scheduler.submit(GenerationRequest.create(PROMPT, 6, greedy=True, ignore_eos=True, logprobs=2))
    events = [e for e in handle if not isinstance(e, Done)]
    assert [e.logprobs[0] for e in events] == result.logprobs[0]
    # Generator.stream: each row's events carry its logprobs, the ones of the result.
    stream = generator.stream([PROMPT, OTHERS[0]], max_new_tokens=3, greedy=True, logprobs=1)
    events = list(stream)
    assert [[e.logprobs[b] for e in events] for b in range(2)] == stream.result.logprobs
    assert all(len(entry.top) == 1 for row in stream.result.logprobs for entry in row)


def test_n_choices_share_one_prefill_and_draw_like_solo_seeds(served) -> None:
    generator, scheduler = served
    options = dict(temperature=1.5, seed=11, ignore_eos=True)
    fresh = [277, 200, 201, 202, 203]  # shares no prefix with earlier requests (the prefix store)
    solos = [generator.generate([fresh], max_new_tokens=8, **{**options, "seed": 11 + i}).tokens[0] for i in range(3)]
    assert len({tuple(s) for s in solos}) == 3  # different seeds, different samples: the checks below can fail
    assert generator.generate([fresh], max_new_tokens=8, n=3, **options).tokens == solos
    before = scheduler.snapshot()["prefilled_tokens"]
    handle = scheduler.submit(GenerationRequest.create(fresh, 8, n=3, logprobs=0, **options))
    events = list(handle)
    assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1, 2]
    assert isinstance(events[-1], Done) and handle.done is events[-1]
    results = handle.results()
    assert [tokens for tokens, _, _ in results] == solos
    assert scheduler.snapshot()["prefilled_tokens"] - before == len(fresh)  # one prefill for the three
    assert all((done.prompt_tokens, done.prefilled_tokens, done.cached_tokens, done.completion_tokens)
               == (len(fresh), len(fresh), 0, 8) for _, _, done in results)
    with pytest.raises(InputError, match=r"^this request has n=3 choices: use results\(\)$"):
        handle.result()
    with pytest.raises(InputError, match=r"^n=4 choices need 4 batch rows at once; this server runs 3 \(max_batch\)$"):
        scheduler.submit(GenerationRequest.create(fresh, 4, n=4))
