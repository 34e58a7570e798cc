"""Tool calling: the Hermes and Llama 3.1 JSON parsers (whole and streamed), the template checks and
format detection, the grammar that forces a call, and `kvforge serve` through the real `openai`
client: a call -> tool message -> answer round trip on a tiny export served with kvforge's
Qwen2.5-style ChatML template with tools (kvforge/data/chatml-tools.jinja), streamed calls equal to
non-streamed ones, and 400s."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from serving import serving

from kvforge.core.errors import InputError
from kvforge.runtime.controls.tool_calls import (
    ToolCall,
    call_grammar,
    check_tool_choice,
    detect_format,
    parse_tool_calls,
    parser_for,
    tool_request,
)
from kvforge.runtime.text.chat import ChatTemplate
from kvforge.runtime.text.messages import check_messages

TOOL_TEMPLATE = (Path(__file__).parents[2] / "kvforge" / "data" / "chatml-tools.jinja").read_text()
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
# A Llama-3.1-style template (written here): calls as {"name": ..., "parameters": ...} JSON.
LLAMA_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{%- for t in tools %}{{ t | tojson(indent=4) }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}"
    "{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- parsers --------------------------------------------------------------------------------------

HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Rome"}), ("add", {"a": 1, "b": 2})]),
    # arguments written as a JSON string are taken too
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call> done',
     "done", [("add", {"a": 3, "b": 4})]),
    # malformed JSON, an unknown tool, an unclosed block: plain content, exactly as generated
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ('Sure <tool_call>\n{"name": "add", "arguments": {"a"', 'Sure <tool_call>\n{"name": "add", "arguments": {"a"', []),
    ("  plain answer <tool_ca", "  plain answer <tool_ca", []),
    # one malformed block beside a good one: the good one is a call, the bad one stays text
    ('<tool_call>{"name": "add"</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>',
     '<tool_call>{"name": "add"</tool_call>', [("add", {"a": 1, "b": 1})]),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": '
     '{"city": "Rome"}}', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    (' \n{"name": "add", "arguments": {"a": 5, "b": 6}}', None, [("add", {"a": 5, "b": 6})]),
    ('{"name": "add", "parameters": {"a": 1}', '{"name": "add", "parameters": {"a": 1}', []),  # malformed
    ('{"name": "add", "parameters": {}} and then text', '{"name": "add", "parameters": {}} and then text', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("The answer is {\"name\": \"add\"}", "The answer is {\"name\": \"add\"}", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"),
                         [("hermes", *case) for case in HERMES_CASES] + [("llama3_json", *case) for case in LLAMA_CASES])
def test_parsers_split_content_and_calls(fmt, text, content, calls) -> None:
    got_content, got_calls = parse_tool_calls(text, fmt, TOOLS)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "text"), [("hermes", c[0]) for c in HERMES_CASES] + [("llama3_json", c[0]) for c in LLAMA_CASES])
def test_streamed_parse_equals_whole_parse(fmt, text) -> None:
    """Fed in pieces of any size (as tokens arrive), the parser settles the same content and calls."""
    whole_content, whole_calls = parse_tool_calls(text, fmt, TOOLS)
    for size in (1, 2, 3, 7):
        parser = parser_for(fmt, TOOLS)
        events = []
        for at in range(0, len(text), size):
            events += parser.feed(text[at:at + size])
        events += parser.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert (content or None if calls else content) == whole_content, size
        assert _calls(calls) == _calls(whole_calls), size


def test_hermes_parser_holds_back_only_a_possible_tag() -> None:
    parser = parser_for("hermes", TOOLS)
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may start a call
    assert parser.feed("box> x") == [" <toolbox> x"]
    assert parser.finish() == []


# -- messages, tools and the template -------------------------------------------------------------

def test_check_messages_takes_tool_calls_and_tool_results() -> None:
    messages = check_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_call_id"] == "call_1"
    bad = [
        ([{"role": "user", "content": None}], "must be a dict with str 'role' and 'content'"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages carry tool calls"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
         "arguments are not valid JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
         "arguments must be a JSON object"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "'function': {'name': str"),
        ([{"role": "assistant", "tool_calls": "f()"}], "'tool_calls' must be a list"),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], "'tool_call_id' must be a str"),
    ]
    for messages, message in bad:
        with pytest.raises(InputError, match=message):
            check_messages(messages)


def test_template_format_detection() -> None:
    for text, want in [(TOOL_TEMPLATE, "hermes"), (LLAMA_TEMPLATE, "llama3_json"), (PLAIN_TEMPLATE, None),
                       ("{% if tools %}{{ tools }}{% endif %}{{ messages }}", None),  # takes tools, writes no calls
                       ("{% for %}", None)]:
        assert detect_format(text, ChatTemplate(text).render) == want, text[:40]
    # A template whose rendering fails is read by its markers.
    failing = "{{ raise_exception('no') }}{% if tools %}<tool_call>{% endif %}"
    assert detect_format(failing, ChatTemplate(failing).render) == "hermes"


def test_rendered_tool_conversation() -> None:
    messages = check_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = ChatTemplate(TOOL_TEMPLATE).render(messages, True, TOOLS)
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text


def test_tool_request_checks() -> None:
    assert tool_request(None, None, None, PLAIN_TEMPLATE, None) is None
    assert tool_request([], "none", None, PLAIN_TEMPLATE, None) is None
    request = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, False, TOOL_TEMPLATE, "hermes")
    assert (request.choice, request.parallel, request.template_tools) == ("add", False, TOOLS)
    assert tool_request(TOOLS, "none", None, TOOL_TEMPLATE, "hermes").template_tools is None
    bad = [
        ((TOOLS, None, None, PLAIN_TEMPLATE, None), "does not support tools"),
        ((TOOLS, None, None, "{{ tools }}", None), "format kvforge does not parse"),
        ((TOOLS, "always", None, TOOL_TEMPLATE, "hermes"), "'tool_choice' must be one of"),
        ((TOOLS, {"type": "function", "function": {"name": "nope"}}, None, TOOL_TEMPLATE, "hermes"), "not in 'tools'"),
        ((None, "required", None, TOOL_TEMPLATE, "hermes"), "needs 'tools'"),
        ((TOOLS, None, "yes", TOOL_TEMPLATE, "hermes"), "'parallel_tool_calls' must be true or false"),
        (([{"type": "function", "function": {"name": "a b"}}], None, None, TOOL_TEMPLATE, "hermes"), "letters, digits"),
        (([TOOLS[0], TOOLS[0]], None, None, TOOL_TEMPLATE, "hermes"), "two tools are named"),
        (([{"type": "retrieval"}], None, None, TOOL_TEMPLATE, "hermes"), r"tools\[0\] must be"),
    ]
    for args, message in bad:
        with pytest.raises(InputError, match=message):
            tool_request(*args)
    with pytest.raises(InputError, match="must be one of"):
        check_tool_choice({"type": "function"}, TOOLS)


# -- the grammar ----------------------------------------------------------------------------------

def _matches(compiled, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` whole (each token allowed, and complete at the end)."""
    from kvforge.core.errors import GrammarError

    matcher = compiled.matcher()
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.advance(token)
    except GrammarError:
        return False
    return matcher.accepting


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_call_grammar_takes_exactly_the_allowed_calls(exported, fmt) -> None:
    from kvforge.runtime import Generator
    from kvforge.runtime.controls.constraint import compiler_for

    generator = Generator(exported("llama-tiny"))
    compiler = compiler_for(generator.vocabulary)

    def call(name, args):
        body = json.dumps({"name": name, "arguments" if fmt == "hermes" else "parameters": args})
        return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body

    weather, add = call("get_weather", {"city": "Rome"}), call("add", {"a": 1, "b": -2})
    required = compiler.compile(call_grammar(fmt, TOOLS, "required", parallel=True))
    named = compiler.compile(call_grammar(fmt, TOOLS, "add", parallel=True))
    tokenizer = generator.tokenizer
    assert _matches(required, tokenizer, weather) and _matches(required, tokenizer, add)
    assert _matches(named, tokenizer, add) and not _matches(named, tokenizer, weather)
    for wrong in (call("get_weather", {"city": "Oslo"}), call("add", {"a": 1}), call("rm", {}), "Sure! " + add):
        assert not _matches(required, tokenizer, wrong), wrong
    assert _matches(required, tokenizer, weather + "\n" + add) == (fmt == "hermes")  # parallel calls: Hermes
    single = compiler.compile(call_grammar(fmt, TOOLS, "required", parallel=False))
    assert _matches(single, tokenizer, weather) and not _matches(single, tokenizer, weather + "\n" + add)


# -- kvforge serve --------------------------------------------------------------------------------

def _install_template(source: Path, folder: Path, template: str) -> Path:
    """A copy of an export with `template` as its chat template, listed (and hashed) in the manifest
    as an export lists the chat_template.jinja it copies."""
    from kvforge.core.manifest import file_record, load_manifest, write_manifest

    shutil.copytree(source, folder)
    (folder / "chat_template.jinja").write_text(template)
    manifest = load_manifest(folder)
    manifest["chat_template"] = "chat_template.jinja"
    manifest["files"]["chat_template.jinja"] = file_record(folder / "chat_template.jinja")
    write_manifest(folder, manifest)
    return folder


@pytest.fixture(scope="module")
def tool_export(exported) -> Path:
    return exported("llama-tiny")  # no template of its own: served with --chat-template chatml-tools


@pytest.fixture(scope="module")
def server(tool_export):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from kvforge.serve.app import create_app

    app = create_app(tool_export, max_batch=2, max_seq_len=1024, model_name="tiny", prefill_chunk=64,
                     chat_template="chatml-tools")
    with serving(app) as base:
        yield base


def _client(base: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def _rendered(reference, messages, tools):
    """The conversation as the server renders it, as a prompt for Generator."""
    from kvforge.runtime.text.prompts import RenderedChat

    text = ChatTemplate(TOOL_TEMPLATE).render(check_messages(messages), True, tools)
    return RenderedChat(reference.tokenizer.encode(text, add_special_tokens=False))


def _reassemble(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) per call and the finish reason of a streamed chat answer."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_tool_call_round_trip_with_the_openai_client(server, tool_export) -> None:
    from kvforge.runtime import Generator

    client = _client(server)
    reference = Generator(tool_export)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "add")
    # The reference: the same rendered prompt through Generator with the same grammar.
    want = reference.generate(_rendered(reference, messages, TOOLS), max_new_tokens=120, greedy=True,
                              grammar=call_grammar("hermes", TOOLS, "required", parallel=False))
    [(name, arguments)] = _calls(parse_tool_calls(want.text[0], "hermes", TOOLS)[1])
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)

    streamed = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True)
    assert _reassemble(streamed) == ("", [(call.function.name, call.function.arguments)], "tool_calls")

    # The tool's result goes back; the answer (tool_choice auto) is the reference's greedy text.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    rendered = ChatTemplate(TOOL_TEMPLATE).render(check_messages(messages), True, TOOLS)
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in rendered
    want = reference.generate(_rendered(reference, messages, TOOLS), max_new_tokens=12, greedy=True)
    content, calls = parse_tool_calls(want.text[0], "hermes", TOOLS)
    assert second.choices[0].message.content == content and not calls
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == ("length" if want.finish_reason[0] == "length" else "stop")


def test_named_tool_choice_calls_that_function(server, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="kvforge.serve")
    client = _client(server)
    messages = [{"role": "user", "content": "Add 2 and 3"}]
    choice = {"type": "function", "function": {"name": "add"}}
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice,
                                            max_tokens=120, temperature=0)
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]
    assert set(json.loads(calls[0].function.arguments)) == {"a", "b"}
    streamed = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice,
                                              max_tokens=120, temperature=0, stream=True)
    assert _reassemble(streamed) == ("", [(c.function.name, c.function.arguments) for c in calls], "tool_calls")
    # The request log says what the client got, not "stop" (issue 43, 22).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        logged = [r.kvforge_fields for r in caplog.records if getattr(r, "kvforge_fields", {}).get("id") == answer.id]
        if logged:
            break
        time.sleep(0.05)
    assert [fields["finish_reason"] for fields in logged] == ["tool_calls"]


def test_tool_choice_none_and_auto_answer_as_without_tools(server, tool_export) -> None:
    """With random weights no call comes out: the answer is the greedy text, streamed or not."""
    from kvforge.runtime import Generator

    client = _client(server)
    reference = Generator(tool_export)
    messages = [{"role": "user", "content": "Hello"}]
    for tool_choice, rendered_tools in (("none", None), ("auto", TOOLS)):
        want = reference.generate(_rendered(reference, messages, rendered_tools), max_new_tokens=10,
                                  greedy=True).text[0]
        got = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=10, temperature=0)
        assert got.choices[0].message.content == want and got.choices[0].message.tool_calls is None
        streamed = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                  tool_choice=tool_choice, max_tokens=10, temperature=0, stream=True)
        assert _reassemble(streamed)[:2] == (want, [])


def test_tool_requests_refused_with_a_clear_400(server, exported, tmp_path) -> None:
    httpx = pytest.importorskip("httpx")
    from kvforge.serve.app import create_app

    def post(base_or_client, body):
        return base_or_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 4, **body})

    with httpx.Client(base_url=server, timeout=30) as client:
        for body, message in [
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                     "properties": {"x": {"type": "nonsense"}}}}}],
              "tool_choice": "required"}, "cannot be enforced"),
            ({"tools": "get_weather"}, "'tools' must be a non-empty list"),
            ({"tool_choice": "required"}, "needs 'tools'"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
             "cannot be combined with a forced tool call"),
        ]:
            response = post(client, body)
            assert response.status_code == 400, body
            assert message in response.json()["error"]["message"], response.json()

    # An export whose own template takes no tools: tools, or a conversation with tool calls, is a 400.
    from fastapi.testclient import TestClient

    plain = _install_template(exported("llama-tiny"), tmp_path / "plain", PLAIN_TEMPLATE)
    with TestClient(create_app(plain, max_batch=1, max_seq_len=128)) as client:
        response = post(client, {"tools": TOOLS})
        assert response.status_code == 400 and "does not support tools" in response.json()["error"]["message"]
        calls = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
        response = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]})
        assert response.status_code == 400 and "does not support tools" in response.json()["error"]["message"]
        assert post(client, {"tools": [], "tool_choice": "none"}).status_code == 200  # neutral values


def test_generator_chat_ids_render_tools(exported, tmp_path) -> None:
    from kvforge.runtime import Generator

    messages = [{"role": "user", "content": "Weather in Rome?"}]
    generator = Generator(_install_template(exported("llama-tiny"), tmp_path / "tools", TOOL_TEMPLATE))
    text = ChatTemplate(TOOL_TEMPLATE).render(check_messages(messages), True, TOOLS)
    assert generator.chat_ids(messages, tools=TOOLS) == generator.tokenizer.encode(text, add_special_tokens=False)
    plain = Generator(_install_template(exported("llama-tiny"), tmp_path / "plain", PLAIN_TEMPLATE))
    with pytest.raises(InputError, match="does not support tools"):
        plain.chat_ids(messages, tools=TOOLS)


def test_a_chat_template_that_cannot_be_read_fails_the_start(exported, tmp_path) -> None:
    pytest.importorskip("fastapi")
    from kvforge.serve.app import create_app

    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9")
    for name in (tmp_path / "missing.jinja", tmp_path / "latin1.jinja"):
        with pytest.raises(InputError, match="cannot read the chat template"):
            create_app(exported("llama-tiny"), max_batch=1, max_seq_len=64, chat_template=name)
