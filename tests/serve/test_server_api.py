"""The server's log-probabilities, echo, batches of prompts, n choices and sampling extensions,
through the real `openai` client, against independent references: numpy log_softmax of the
logits `Generator.generate(..., keep_logits=True)` returns, `Generator.score`, and the Python API
with the same options."""

from __future__ import annotations

import time

import numpy as np
import pytest
from serving import serving

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


from kvforge.runtime import Generator  # noqa: E402
from kvforge.serve.app import create_app  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def base(chat_export):
    app = create_app(chat_export, max_batch=4, max_seq_len=256, model_name="tiny", prefill_chunk=16, max_queue=8)
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def reference(chat_export):
    return Generator(chat_export)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_chat_logprobs_are_log_softmax_of_the_logits(client, reference) -> None:
    want = reference.chat(MESSAGES, max_new_tokens=8, greedy=True, keep_logits=True)
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=5)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.tokens[0]) == got.usage.completion_tokens
    for step, (entry, token) in enumerate(zip(content, want.tokens[0], strict=True)):
        logp = _log_softmax(want.logits[step][0])
        assert abs(entry.logprob - logp[token]) < TOL
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        np.testing.assert_allclose(tops, np.sort(logp)[::-1][:5], atol=TOL)
        assert entry.logprob == tops[0]  # greedy: the chosen token is the most likely one, the same number
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].bytes == entry.bytes
    if got.choices[0].finish_reason == "length":  # no special token: the bytes spell the answer
        text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
        assert text == got.choices[0].message.content == want.text[0]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == want.text[0]


def test_streamed_logprobs_equal_the_non_streamed_ones(client) -> None:
    options = {"model": "tiny", "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **options)
    chunks = list(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True,
                                                 **options))
    # Equal up to float noise: the second request reuses the first one's prompt KV rows (prefix cache).
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    entries = whole.choices[0].logprobs.content
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in entries]
    np.testing.assert_allclose([[e.logprob] + [t.logprob for t in e.top_logprobs] for e in streamed],
                               [[e.logprob] + [t.logprob for t in e.top_logprobs] for e in entries], atol=TOL)

    whole = client.completions.create(prompt="Once upon a time", logprobs=2, **options)
    chunks = list(client.completions.create(prompt="Once upon a time", logprobs=2, stream=True, **options))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    legacy = whole.choices[0].logprobs
    assert [v for p in pieces for v in p.tokens] == legacy.tokens
    assert [v for p in pieces for v in p.text_offset] == legacy.text_offset
    np.testing.assert_allclose([v for p in pieces for v in p.token_logprobs], legacy.token_logprobs, atol=TOL)
    tops = [v for p in pieces for v in p.top_logprobs]
    assert [sorted(t) for t in tops] == [sorted(t) for t in legacy.top_logprobs]
    np.testing.assert_allclose([sorted(t.values()) for t in tops], [sorted(t.values()) for t in legacy.top_logprobs],
                               atol=TOL)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_completions_logprobs_have_openais_legacy_shape(client, reference) -> None:
    prompt = "The quick brown fox"
    want = reference.generate(prompt, max_new_tokens=6, greedy=True, keep_logits=True)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for step, token in enumerate(want.tokens[0]):
        logp = _log_softmax(want.logits[step][0])
        assert abs(lp.token_logprobs[step] - logp[token]) < TOL
        top = lp.top_logprobs[step]
        assert lp.tokens[step] in top and 3 <= len(top) <= 4  # the 3 most likely, and the chosen token
        assert max(top.values()) == lp.token_logprobs[step]  # greedy (what lm-eval's is_greedy checks)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_scores_the_prompt_as_generator_score(client, reference) -> None:
    text = "Once upon a time there was a small model"
    ids = reference.tokenizer.encode(text)
    score = reference.score(ids)
    got = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1)
    choice = got.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and got.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], score, atol=1e-6)
    assert got.usage.prompt_tokens == len(ids) == len(choice.logprobs.tokens)
    assert text[choice.logprobs.text_offset[-1]:] == choice.logprobs.tokens[-1]

    # A batch of token-id prompts, echoed with one generated token (what lm-eval sends): one choice
    # per prompt in order, the prompt's part equal to score(), then the generated token's.
    batch = [ids, ids[:5], reference.tokenizer.encode("def main(): return 42")]
    got = client.completions.create(model="tiny", prompt=batch, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for row, choice in zip(batch, got.choices, strict=True):
        logprobs = choice.logprobs.token_logprobs
        assert len(logprobs) == len(row) + 1
        np.testing.assert_allclose(logprobs[1:len(row)], reference.score(row), atol=1e-6)
        generated = reference.generate([row], max_new_tokens=1, greedy=True, keep_logits=True)
        assert abs(logprobs[-1] - _log_softmax(generated.logits[0][0]).max()) < TOL
        assert choice.text == reference.tokenizer.decode(row) + reference.tokenizer.decode(generated.tokens[0])
    # Without logprobs, echo is just the prompt before the answer.
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=3, echo=True, temperature=0).choices[0]
    assert plain.logprobs is None
    assert plain.text == text + reference.generate(text, max_new_tokens=3, greedy=True).text[0]


def test_n_choices_are_the_lone_requests_with_seed_plus_index(client) -> None:
    options = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9, "seed": 11}
    got = client.completions.create(n=3, **options)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):
        alone = client.completions.create(n=1, **{**options, "seed": 11 + i}).choices[0]
        assert choice.text == alone.text
    assert len({c.text for c in got.choices}) > 1  # different streams
    assert got.usage.prompt_tokens == client.completions.create(n=1, **options).usage.prompt_tokens

    chunks = list(client.completions.create(n=3, stream=True, **options))
    texts = ["", "", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in got.choices]
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 3

    # Two prompts x n=2: index = prompt x n + choice.
    batch = client.completions.create(**{**options, "prompt": ["Once upon a time", "hello"]}, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == got.choices[0].text and batch.choices[1].text == got.choices[1].text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, temperature=0)
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer twice


def test_sampling_extensions_and_penalties_match_the_python_api(client, reference) -> None:
    assert reference.default_sampling.greedy  # the tiny export decodes greedily by default
    changed = False
    for prompt in ("The quick brown fox", "a b c d e f g", "hello"):
        penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.5}
        want = reference.generate(prompt, max_new_tokens=12, greedy=True, **penalties).text[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"repetition_penalty": 1.5},
                                        presence_penalty=0.8, frequency_penalty=0.6).choices[0].text
        assert got == want
        changed |= got != reference.generate(prompt, max_new_tokens=12, greedy=True).text[0]
        sampled = reference.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=8, min_p=0.05, seed=5).text[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=5,
                                        extra_body={"top_k": 8, "min_p": 0.05}).choices[0].text
        assert got == sampled
        # Filters at their "off" values, no temperature: the export's own decoding (not sampling).
        off = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, top_p=1,
                                        extra_body={"top_k": -1, "min_p": 0}).choices[0].text
        assert off == reference.generate(prompt, max_new_tokens=12).text[0]
    assert changed  # the penalties did something on at least one prompt


REFUSED = [
    ("/v1/completions", {"logit_bias": {"5": 3}}, "logit_bias", "not supported"),
    ("/v1/completions", {"best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "between 0 and 20"),
    ("/v1/completions", {"echo": "yes"}, "echo", "true or false"),
    ("/v1/completions", {"prompt": ["a", [5, 6]]}, "prompt", "(not a mix)"),
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt", "at most 8"),
    ("/v1/completions", {"n": 5}, None, "batch rows"),
    ("/v1/completions", {"min_p": 2}, "min_p", "between 0.0 and 1.0"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "between"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", "between 1"),
]


@pytest.mark.parametrize(("path", "fields", "param", "message"), REFUSED, ids=[str(r[1]) for r in REFUSED])
def test_refused_fields_are_400_saying_why(base, path, fields, param, message) -> None:
    body = {"max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": "hello"}), **fields}
    response = httpx.post(f"{base}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_prompt_logprobs_are_score_with_the_top_tokens(reference) -> None:
    from kvforge.core.errors import InputError

    ids = reference.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    entries = reference.prompt_logprobs(ids, top=4)
    assert entries[0] is None and [e.token for e in entries[1:]] == ids[1:]
    np.testing.assert_allclose([e.logprob for e in entries[1:]], reference.score(ids), atol=1e-9)
    for entry in entries[1:]:
        values = [lp for _, lp in entry.top]
        assert len(values) == 4 and values == sorted(values, reverse=True) and values[0] >= entry.logprob
    assert reference.prompt_logprobs(ids[:1]) == [None]
    with pytest.raises(InputError, match="0..20"):
        reference.prompt_logprobs(ids, top=21)


def test_a_batch_with_n_choices_is_one_log_line_with_its_usage(base, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="kvforge.serve")
    bodies = [{"prompt": ["Once upon a time", "def main"], "n": 2, "max_tokens": 3, "temperature": 0.5, "seed": 1},
              {"prompt": ["hello", "a b c"], "max_tokens": 0, "echo": True, "logprobs": 1}]
    for body in bodies:
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        rid, usage = response.headers["x-request-id"], response.json()["usage"]
        for _ in range(100):  # written when the response ends
            lines = [r for r in caplog.records if r.name == "kvforge.serve" and r.kvforge_fields["id"] == rid]
            if lines:
                break
            time.sleep(0.02)
        assert len(lines) == 1
        fields = lines[0].kvforge_fields
        assert fields["status"] == 200 and fields["finish_reason"] == "length"
        assert (fields["prompt_tokens"], fields["completion_tokens"]) == (usage["prompt_tokens"],
                                                                          usage["completion_tokens"])
    assert usage["completion_tokens"] == 0


def test_ignore_eos_extension_runs_to_max_tokens_as_the_python_api(client, reference, base) -> None:
    # A prompt whose greedy answer ends at the model's end-of-sequence token well before 24 tokens.
    prompt = next(p for p in ([1, 5 + i, 9 + 3 * i] for i in range(200))
                  if reference.generate([p], max_new_tokens=24, greedy=True).finish_reason == ["eos"])
    short = reference.generate([prompt], max_new_tokens=24, greedy=True)
    full = reference.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True)
    assert len(short.tokens[0]) < 24 == len(full.tokens[0])
    for ignore, want in ((True, full), (False, short)):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": ignore})
        assert got.usage.completion_tokens == len(want.tokens[0])
        assert got.choices[0].finish_reason == ("length" if ignore else "stop")
        assert got.choices[0].text == reference.tokenizer.decode(want.tokens[0], skip_special_tokens=True)
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "ignore_eos": "yes"}, timeout=30)
    assert response.status_code == 400 and "ignore_eos must be true or false" in response.json()["error"]["message"]
