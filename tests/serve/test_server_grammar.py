"""`response_format` on `kvforge serve` through the real `openai` client: a random-weight model still
answers schema-valid JSON (the grammar forces it), equal to `Generator` with the same grammar;
constrained and unconstrained requests share a batch without changing the unconstrained answers;
a grammar that cannot compile is a 400 with the compiler's message."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import pytest
from serving import serving, with_template

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import pydantic  # noqa: E402

from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.controls.constraint import Grammar  # noqa: E402
from kvforge.serve.app import create_app  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
EMAIL = r"[a-z]{3,8}@example\.(com|org)"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                   "sunny": {"type": "boolean"}},
    "required": ["city", "rank", "sunny"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict schemas
    name: str = pydantic.Field(max_length=10)
    level: int = pydantic.Field(ge=1, le=9)
    colour: Literal["red", "blue"]


@pytest.fixture(scope="module")
def chat_export(exported, tmp_path_factory) -> Path:
    """The session's tiny export with a chat template (listed and hashed in its manifest)."""
    return with_template(exported("llama-tiny", "ort"), tmp_path_factory.mktemp("grammar") / "chat", TEMPLATE)


@pytest.fixture(scope="module")
def base(chat_export):
    app = create_app(chat_export, max_batch=4, max_seq_len=256, model_name="tiny", prefill_chunk=16)
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def reference(chat_export) -> Generator:
    return Generator(chat_export)


def _client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_pydantic_model_parses(base) -> None:
    client = _client(base)
    for question in ("Who are you?", "Describe a person.", "Any name will do"):
        got = client.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": question}],
                                                 response_format=Person, max_tokens=60, temperature=0)
        person = got.choices[0].message.parsed
        assert isinstance(person, Person) and 1 <= person.level <= 9, got.choices[0].message.content


def test_sampled_choices_follow_the_grammar(reference) -> None:
    # Sampling from a random-weight model, each of n choices with its own matcher: all still parse.
    result = reference.generate("Who are you?", max_new_tokens=60, temperature=1.0, seed=0, n=3,
                                grammar=Grammar.json_schema(Person))
    assert len(result.text) == 3 and len(set(result.text)) > 1, result.text
    for text in result.text:
        Person.model_validate_json(text)


def test_json_schema_equals_generator_with_the_grammar(base, reference) -> None:
    messages = [{"role": "user", "content": "The weather, please."}]
    want = reference.chat(messages, max_new_tokens=60, greedy=True, grammar=Grammar.json_schema(SCHEMA))
    json.loads(want.text[0])  # the grammar finished within max_new_tokens
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    got = _client(base).chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                                response_format=response_format)
    assert got.choices[0].message.content == want.text[0]
    assert got.choices[0].finish_reason == "stop"
    streamed = _client(base).chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                                     response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text[0]


def test_regex_completion_matches(base, reference) -> None:
    for prompt in ("Contact:", "Send mail to", "hello"):
        got = _client(base).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"response_format": {"type": "regex", "regex": EMAIL}})
        assert re.fullmatch(EMAIL, got.choices[0].text), got.choices[0].text
        assert got.choices[0].text == reference.generate(prompt, max_new_tokens=24, greedy=True,
                                                         grammar=Grammar.regex(EMAIL)).text[0]


def test_lark_json_object_and_text(base, reference) -> None:
    lark = 'start: "(" item ("," item){0,3} ")"\nitem: /[0-9]{1,3}/ | "foo" | "bar"\n'
    got = _client(base).completions.create(model="tiny", prompt="A list:", max_tokens=24, temperature=0,
                                           extra_body={"response_format": {"type": "lark", "grammar": lark}})
    assert re.fullmatch(r"\((\d{1,3}|foo|bar)(,(\d{1,3}|foo|bar)){0,3}\)", got.choices[0].text), got.choices[0].text
    messages = [{"role": "user", "content": "JSON please"}]
    want = reference.chat(messages, max_new_tokens=40, greedy=True, grammar=Grammar.json_object())
    got = _client(base).chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                response_format={"type": "json_object"})
    assert got.choices[0].message.content == want.text[0] and want.text[0].startswith("{")
    plain = _client(base).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                  response_format={"type": "text"})
    assert plain.choices[0].message.content == reference.chat(messages, max_new_tokens=8, greedy=True).text[0]


def test_constrained_and_unconstrained_requests_in_one_batch(base, reference) -> None:
    prompts = ["The quick brown fox", "Once upon a time", "hello there", "a b c d"]
    jobs = [(p, i % 2 == 1) for i, p in enumerate(prompts * 2)]  # every other one constrained, 4 rows at once

    def run(job):
        prompt, constrained = job
        extra = {"response_format": {"type": "regex", "regex": EMAIL}} if constrained else {}
        return _client(base).completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                                extra_body=extra).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    for (prompt, constrained), text in zip(jobs, texts, strict=True):
        want = reference.generate(prompt, max_new_tokens=20, greedy=True,
                                  grammar=Grammar.regex(EMAIL) if constrained else None).text[0]
        assert text == want, (prompt, constrained)
        assert not constrained or re.fullmatch(EMAIL, text)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "regex", "regex": "[a-"}, "unclosed character class"),
    ({"type": "lark", "grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, '"json_schema": {"name": ..., "schema": {...}}'),
    ({"type": "xml"}, "type must be one of text, json_object, json_schema, regex, lark"),
    ({"type": "regex", "pattern": "a"}, "takes ['type', 'regex'], not ['pattern']"),
    ("json", "must be an object with a 'type'"),
])
def test_bad_response_format_is_400_with_the_message(base, response_format, message) -> None:
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                          "response_format": response_format}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and message in error["message"], error
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
