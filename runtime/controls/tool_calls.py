"""Tool calling: which tool-call format a chat template speaks, OpenAI's `tools` / `tool_choice`
checked, tool calls parsed out of the generated text (whole or streamed), and the grammar that
forces a call (`tool_choice` "required" or a named function).

Two formats, the ones open models are trained on:

- "hermes" (Qwen2.5, Qwen3, Hermes, SmolLM3 ...): each call is
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, possibly after some text and
  several in a row.
- "llama3_json" (Llama 3.1 / 3.2 / 3.3): the whole answer is `{"name": "f", "parameters": {...}}`,
  possibly after `<|python_tag|>`; several calls are separated by ";".

A template's format is read from what it renders: a probe conversation with one tool call is rendered
(in the server's killable renderer) and the call's shape recognised; the template's text is the
fallback. Parsing is incremental (`ToolCallParser.feed`), and the whole-text parse is the same
parser fed once, so a streamed answer reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError

if TYPE_CHECKING:
    from kvforge.runtime.controls.constraint import Grammar

FORMATS = ("hermes", "llama3_json")
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (also keeps grammars simple)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The grammar's JSON is written the way json.dumps writes it: flexible whitespace would let a weak
# model pad forever (runtime/controls/constraint.py's JSON_OPTIONS).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is the JSON text of the arguments object (OpenAI's form)."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's message.tool_calls item (with `index`: a delta.tool_calls item)."""
        item: dict[str, Any] = {} if index is None else {"index": index}
        item.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return item


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the template ---------------------------------------------------------------------------------

def template_takes_tools(text: str) -> bool:
    """Whether the template reads a `tools` variable (parsed, not run: parsing executes nothing)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(text))
    except Exception:  # noqa: BLE001 (a template Jinja cannot parse takes nothing; rendering reports it)
        return False


PROBE_NAME = "kvforge_probe"
PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
PROBE_MESSAGES = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function", "function": {"name": PROBE_NAME, "arguments": {"probe": 1}}}]},
]


def detect_format(text: str, render: Callable[..., str] | None = None) -> str | None:
    """The tool-call format of a template that takes `tools` (None: it takes none, or speaks a
    format kvforge does not parse). `render(messages, add_generation_prompt, tools)` renders the
    probe conversation; what the probe call was written as decides, else markers in the text."""
    if not template_takes_tools(text):
        return None
    if render is not None:
        try:
            rendered = render(PROBE_MESSAGES, False, PROBE_TOOLS)
        except InputError:
            rendered = ""
        # The call is written after the tool list (where the probe tool's own object has the same
        # name but a description next): the last match that reads as a call decides.
        for match in reversed(list(re.finditer(r'\{\s*"name"\s*:\s*"' + PROBE_NAME + '"', rendered))):
            if rendered[:match.start()].rstrip().endswith(HERMES_OPEN):
                return "hermes"
            if re.match(r'\s*,\s*"parameters"', rendered[match.end():]):
                return "llama3_json"
    if HERMES_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or '"parameters": ' in text:
        return "llama3_json"
    return None


# -- the request ----------------------------------------------------------------------------------

def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}; names as OpenAI allows them, unique."""
    if not isinstance(tools, list) or not tools:
        raise InputError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise InputError(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InputError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"...}}}}, got {tool!r}"[:300])
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"[:300])
        if name in seen:
            raise InputError(f"tools[{i}]: two tools are named {name!r}")
        seen.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise InputError(f"tools[{i}].function.description must be a string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                             f"{function['parameters']!r}"[:300])
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str:
    """"none", "auto", "required", or the name of the function a named choice forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InputError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"[:300])
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function" or not isinstance(function.get("name"), str):
        raise InputError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"[:300])
    names = [tool["function"]["name"] for tool in tools]
    if function["name"] not in names:
        raise InputError(f"'tool_choice' names function {function['name']!r}, which is not in 'tools' "
                         f"({', '.join(names)})"[:300])
    return function["name"]


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: what the template is given, how the answer is parsed, and whether a
    call is forced. `choice`: "none" (tools left out of the prompt, the answer is text), "auto",
    "required" or the name of the function that must be called."""

    tools: list[dict[str, Any]]
    choice: str
    fmt: str
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.choice == "none" else self.tools

    def parser(self) -> ToolCallParser | None:
        return None if self.choice == "none" else parser_for(self.fmt, self.tools)

    def grammar(self) -> Grammar | None:
        """The grammar that forces the call, for "required" and a named function."""
        return None if self.choice in ("none", "auto") else call_grammar(self.fmt, self.tools, self.choice,
                                                                        self.parallel)


def tool_request(tools: Any, choice: Any, parallel: Any, template_text: str | None, fmt: str | None,
                 source: str = "the chat template") -> ToolRequest | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked against the template (None:
    no tools asked for). InputError for bad values and for a template that cannot take them."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InputError(f"'parallel_tool_calls' must be true or false, got {parallel!r}"[:300])
    if tools is None or tools == []:
        if choice is not None and choice not in ("none", "auto"):
            raise InputError(f"'tool_choice' {choice!r} needs 'tools'"[:300])
        return None
    tools = check_tools(tools)
    choice = check_tool_choice(choice, tools)
    return ToolRequest(tools, choice, check_tool_support(template_text, fmt, source), parallel is not False)


def check_tool_support(template_text: str | None, fmt: str | None, source: str = "the chat template") -> str:
    """`fmt`, or an InputError saying why this template cannot take tools (or show tool calls)."""
    if template_text is None or not template_takes_tools(template_text):
        raise InputError(f"{source} does not support tools (it never reads a `tools` variable), so this model "
                         "cannot be given 'tools' or assistant 'tool_calls'; leave them out, or serve a model "
                         "whose chat template takes them (Qwen2.5, Llama 3.1, ...)")
    if fmt is None:
        raise InputError(f"{source} takes tools, but writes tool calls in a format kvforge does not parse (it "
                         f"parses {' and '.join(FORMATS)}: <tool_call> blocks, or Llama 3.1's JSON); leave "
                         "'tools' out")
    return fmt


# -- the answer -----------------------------------------------------------------------------------

def _call(obj: Any, names: frozenset[str], arguments_key: str) -> ToolCall | None:
    """A ToolCall from a decoded JSON call, or None when it is not one (then it stays text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives. `feed(text)` and `finish()`
    return what is settled: str pieces of content and ToolCalls, in order. Text that may be the
    start of a call is held back until it is known; whitespace next to a call is dropped."""

    def __init__(self, names: list[str] | frozenset[str]) -> None:
        self.names = frozenset(names)
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        raise NotImplementedError

    def finish(self) -> list[str | ToolCall]:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks anywhere in the text; a
    block that is not a valid call of a known tool (or is not closed) stays text."""

    def __init__(self, names: list[str] | frozenset[str]) -> None:
        super().__init__(names)
        self.buffer = ""  # text not yet settled
        self.space = ""  # whitespace after the last content, emitted only if content follows
        self.after_call = False  # drop whitespace right after a call

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if body:
            out.append(self.space + body)
            self.space = ""
        self.space += text[len(body):]

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buffer += text
        out: list[str | ToolCall] = []
        while self.buffer:
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>".
                keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(self.buffer)), 0, -1)
                             if HERMES_OPEN.startswith(self.buffer[-k:])), 0)
                self._content(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._content(self.buffer[:start], out)
            end = self.buffer.find(HERMES_CLOSE, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start:end + len(HERMES_CLOSE)]
            self.buffer = self.buffer[end + len(HERMES_CLOSE):]
            call = _call(_loads(block[len(HERMES_OPEN):-len(HERMES_CLOSE)].strip()), self.names, "arguments")
            if call is None:
                self._content(block, out)
            else:
                self.space, self.after_call = "", True
                self.calls += 1
                out.append(call)
        return out

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._content(self.buffer, out)  # an unclosed block (or a held-back tail) is text
        self.buffer = ""
        if self.space and not self.calls:
            out.append(self.space)  # no call: the text is exactly what was generated
        self.space = ""
        return out


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (several
    separated by ";"), possibly after `<|python_tag|>`. An answer that starts otherwise streams as
    text at once; one that starts like a call is held to the end and is text unless all of it parses."""

    def __init__(self, names: list[str] | frozenset[str]) -> None:
        super().__init__(names)
        self.buffer = ""
        self.mode = "undecided"  # -> "text" or "held"

    def feed(self, text: str) -> list[str | ToolCall]:
        if self.mode == "text":
            return [text] if text else []
        self.buffer += text
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # still may be a call
            if head.startswith(("{", PYTHON_TAG)):
                self.mode = "held"
                return []
            self.mode, out, self.buffer = "text", self.buffer, ""
            return [out]
        return []

    def finish(self) -> list[str | ToolCall]:
        text, self.buffer = self.buffer, ""
        if self.mode == "text" or not text:
            return [text] if text else []
        calls = self._calls(text.strip())
        if calls is None:
            return [text]
        self.calls = len(calls)
        return list(calls)

    def _calls(self, text: str) -> list[ToolCall] | None:
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            call = _call(obj, self.names, "parameters")
            if call is None:
                return None
            calls.append(call)
            rest = text[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            rest = rest[1:].lstrip()
            if not rest:
                return calls
            at = len(text) - len(rest)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for(fmt: str, tools: list[dict[str, Any]]) -> ToolCallParser:
    return PARSERS[fmt]([tool["function"]["name"] for tool in tools])


def parse_tool_calls(text: str, fmt: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """The content (None when the answer is only calls) and the calls of a whole answer."""
    parser = parser_for(fmt, tools)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if calls else content, calls


def answer_message(text: str, tools: ToolRequest | None) -> tuple[dict[str, Any], bool]:
    """OpenAI's assistant message for a whole answer, and whether it calls tools."""
    if tools is None or tools.choice == "none":
        return {"role": "assistant", "content": text}, False
    content, calls = parse_tool_calls(text, tools.fmt, tools.tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message, bool(calls)


class DeltaStream:
    """A streamed answer as OpenAI's chunk deltas: {"content": ...} pieces, and each tool call in
    one {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]} when it closes."""

    def __init__(self, tools: ToolRequest) -> None:
        self.parser = tools.parser()
        self.calls = 0

    def _deltas(self, pieces: list[str | ToolCall]) -> list[dict[str, Any]]:
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            else:
                out.append({"tool_calls": [piece.openai(index=self.calls)]})
                self.calls += 1
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return [] if self.parser is None else self._deltas(self.parser.finish())


# -- the grammar that forces a call ---------------------------------------------------------------

def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def call_grammar(fmt: str, tools: list[dict[str, Any]], choice: str, parallel: bool = True) -> Grammar:
    """The grammar of an answer that is tool calls only: one call of the named function (`choice` a
    name), or of any tool ("required"; several in a row when `parallel`, Hermes only)."""
    from kvforge.runtime.controls.constraint import Grammar

    chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    key = "arguments" if fmt == "hermes" else "parameters"
    schemas = [_call_schema(t, key) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "llama3_json":
        return Grammar.json_schema(schema)
    body = json.dumps({**schema, "x-guidance": JSON_STYLE})
    repeat = ' ("\\n" call)*' if parallel and choice == "required" else ""
    return Grammar.lark(f'start: call{repeat}\ncall: "{HERMES_OPEN}\\n" args "\\n{HERMES_CLOSE}"\nargs: %json {body}\n')
