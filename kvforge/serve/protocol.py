"""The OpenAI request bodies `kvforge serve` takes, as pydantic models: one per endpoint with a body
(`CompletionRequest` for /v1/completions, `ChatCompletionRequest` for /v1/chat/completions; GET
/v1/models, /health and /metrics take none). A body is validated against its model once, at the
boundary, by the endpoint's FastAPI dependency (kvforge/serve/app.py); handlers get the validated model. What needs the loaded export
(context and vocabulary limits, the chat template, grammar compilation) is checked by the handlers.

Every refusal keeps the OpenAI error this server has always given: `api_error` turns pydantic's
errors into the same `error.message` / `param` / `code`, and the checks pydantic has no words for
raise `refusal(...)`, whose text is used as it is. Unknown parameters are refused (extra="forbid");
OpenAI parameters this server does not implement are accepted only with their neutral value."""

# No `from __future__ import annotations`: pydantic and FastAPI read these annotations at runtime.
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvforge.core.errors import InputError
from kvforge.runtime.controls.logprobs import MAX_LOGPROBS
from kvforge.runtime.controls.request import MAX_CHOICES
from kvforge.runtime.text.messages import MessageKeyError, check_messages
from kvforge.serve.guard import ApiError

REFUSED = "kvforge"  # the pydantic error type of a `refusal`: its message is the client's, as written


def refusal(message: str, param: str | None = None, code: str | None = None) -> PydanticCustomError:
    """A validation error whose OpenAI message, param and code are given here (not pydantic's words)."""
    return PydanticCustomError(REFUSED, "{message}", {"message": message, "param": param, "code": code})


# OpenAI parameters this server does not implement, accepted only with the value that changes nothing
# (or null), so that a client asking for them learns that it does not get them.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,),
}


def _neutral(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name
    if value is None or any(type(value) is type(n) and value == n for n in NEUTRAL_VALUES[name]):
        return value
    raise refusal(f"'{name}' is not supported by this server (it would be ignored); leave it out or set it to "
                  f"{NEUTRAL_VALUES[name][0]!r}", name, "unsupported_parameter")


def _stream_options(value: Any) -> Any:
    if value is not None and (not isinstance(value, dict) or set(value) - {"include_usage"}
                              or not isinstance(value.get("include_usage", False), bool)):
        raise refusal("'stream_options' may only hold 'include_usage' (true or false); the usage is sent on the "
                      "last chunk", "stream_options")
    return value


def _stop(value: Any) -> list[str] | None:
    """A list of stop strings (one string is a list of one)."""
    if value is None:
        return None
    stop = [value] if isinstance(value, str) else value
    if isinstance(stop, list) and len(stop) > 4:  # OpenAI's own limit
        raise refusal("'stop' takes at most 4 strings", "stop")
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        # The words of GenerationRequest's own check, which answered this before.
        raise refusal(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    return stop


def _ignore_eos(value: Any) -> bool:
    if not isinstance(value, bool):  # the words of GenerationRequest's own check, which answered this before
        raise refusal(f"ignore_eos must be true or false, got {value!r}", "ignore_eos")
    return value


def _speculate(value: Any) -> Any:
    """kvforge's {"method": ..., "draft_len": N}, or false (or {"method": "off"}) for no speculation whatever the
    server's default (kvforge/serve/speculation.py); the method's name and draft_len are the runtime's to check."""
    if value is False:
        return value
    if value is not None and (not isinstance(value, dict) or set(value) - {"method", "draft_len"}
                              or not isinstance(value.get("method"), str)):
        raise refusal("'speculate' must be an object {\"method\": \"prompt-lookup\", \"draft_len\": N} "
                      f"(draft_len optional) or false, got {value!r}"[:300], "speculate")
    return value


RESPONSE_FORMATS = {"text": (), "json_object": (), "json_schema": ("json_schema",), "regex": ("regex",),
                    "lark": ("grammar",)}


def _response_format(value: Any) -> Any:
    """The Grammar (runtime/controls/constraint.py) a `response_format` asks for, or None for plain text.
    OpenAI's {"type": "text"}, {"type": "json_object"} and {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}, and kvforge's {"type": "regex", "regex": ...} and
    {"type": "lark", "grammar": ...}. Compiling it needs the export's vocabulary: the handler's."""
    from kvforge.runtime.controls.constraint import Grammar  # llguidance: only when a grammar is asked for

    def bad(message: str) -> PydanticCustomError:
        return refusal(f"'response_format' {message}", "response_format")

    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad(f"must be an object with a 'type', got {value!r}"[:300])
    kind, fields = value["type"], RESPONSE_FORMATS.get(value["type"])
    if fields is None:
        raise bad(f"type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}")
    extra = set(value) - {"type", *fields}
    if extra:
        raise bad(f"of type {kind!r} takes {['type', *fields]}, not {sorted(extra)}")
    try:
        if kind in ("text", "json_object"):
            return Grammar.json_object() if kind == "json_object" else None
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad('of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
            extra = set(spec) - {"name", "schema", "strict", "description"}
            if extra:
                raise bad(f"json_schema takes name, schema, strict and description, not {sorted(extra)}")
            return Grammar.json_schema(spec["schema"])
        text = value.get(fields[0])
        if not isinstance(text, str):
            raise bad(f'of type "{kind}" needs "{fields[0]}" as a string')
        return Grammar.regex(text) if kind == "regex" else Grammar.lark(text)
    except InputError as err:
        raise bad(f"is not usable: {err}") from None


def _prompt(value: Any, typed: Any) -> Any:
    """/v1/completions' prompt forms (the union below, checked by pydantic's own code: a batch may hold
    a million token ids), or one message for every other value, missing included."""
    try:
        return typed(value)
    except ValidationError:
        raise refusal("'prompt' must be a non-empty string, a list of token ids, or a batch: a non-empty list of "
                      "strings or of token-id lists (not a mix)", "prompt") from None


def _messages(value: Any) -> list[dict[str, Any]]:
    """The messages as the template gets them (runtime/text/messages.py checks every key of every message)."""
    if not isinstance(value, list) or not value:
        raise refusal("'messages' must be a non-empty list of {role, content} objects", "messages")
    try:
        return check_messages(value, keep_images=True)  # a text export refuses image parts when it renders them
    except MessageKeyError as err:
        raise refusal(str(err), "messages", "unsupported_parameter") from None
    except InputError as err:
        raise refusal(str(err), "messages") from None


Ids = Annotated[list[int], Field(min_length=1)]
# Left to right: the first form that fits is taken, without trying the others on a long batch.
Prompt = Annotated[str | Ids | Annotated[list[str], Field(min_length=1)] | Annotated[list[Ids], Field(min_length=1)],
                   Field(union_mode="left_to_right"), WrapValidator(_prompt)]
Neutral = Annotated[Any, PlainValidator(_neutral)]
# A float in [-2, 2] (OpenAI's penalties); a finite number, as every float here (allow_inf_nan=False).
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


class OpenAIRequest(BaseModel):
    """The parameters both endpoints take (README, "Serving"); `user` is only an identifier. top_k,
    min_p, repetition_penalty and ignore_eos are extensions (vLLM's names; llama-server takes
    ignore_eos too); so is kvforge's `speculate`. A null parameter is one not sent, but for the flags
    (stream, echo, ignore_eos), which must be true or false. Numbers are strict: 2.0 is not an integer, true not a
    number."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    NEUTRAL: ClassVar[frozenset[str]] = frozenset({"logit_bias", "best_of", "suffix", "functions", "function_call"})

    model: str | None = None  # another model's name is a 404 before validation (app.py)
    stream_options: Annotated[Any, PlainValidator(_stream_options, json_schema_input_type=dict[str, bool] | None)] = None
    stream: bool = False
    # Their range is the served context's: checked by the handler, with the export loaded.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: Annotated[Any, PlainValidator(_stop, json_schema_input_type=str | list[str] | None)] = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's -1 means off, as our 0
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    speculate: Annotated[Any, PlainValidator(_speculate, json_schema_input_type=dict[str, Any] | bool | None)] = None
    # Validated into the Grammar it asks for (None: plain text).
    response_format: Annotated[Any, PlainValidator(_response_format,
                                                   json_schema_input_type=dict[str, Any] | None)] = None
    ignore_eos: Annotated[bool, PlainValidator(_ignore_eos, json_schema_input_type=bool)] = False
    user: Any = None
    logit_bias: Neutral = None
    best_of: Neutral = None
    suffix: Neutral = None
    functions: Neutral = None
    function_call: Neutral = None

    @model_validator(mode="before")
    @classmethod
    def _unknown_nulls(cls, data: Any) -> Any:
        # An unknown parameter sent as null asks for nothing: accepted, as it always was (some clients
        # write every parameter they know of, null when unset).
        if isinstance(data, dict) and any(v is None and k not in cls.model_fields for k, v in data.items()):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data

    @classmethod
    def taken(cls) -> list[str]:
        """The parameters this endpoint implements, as the refusal of an unknown one lists them."""
        return sorted(set(cls.model_fields) - cls.NEUTRAL)

    @property
    def choices(self) -> int:
        return self.n or 1

    def alternatives(self) -> int | None:
        """Log-probability alternatives per step wanted (0..20), or None for no log-probabilities."""
        raise NotImplementedError


class CompletionRequest(OpenAIRequest):
    """/v1/completions: `prompt` a string, a list of token ids, or a batch of either; `logprobs` an
    integer (false or null: off); `echo`."""

    NEUTRAL: ClassVar[frozenset[str]] = OpenAIRequest.NEUTRAL | {"tools", "tool_choice", "parallel_tool_calls"}

    prompt: Prompt = Field(None, validate_default=True)  # missing: the same 400 as a wrong one
    echo: bool = False
    logprobs: Annotated[int | None, BeforeValidator(lambda v: None if v is False else v)] = Field(
        None, ge=0, le=MAX_LOGPROBS)
    tools: Neutral = None
    tool_choice: Neutral = None
    parallel_tool_calls: Neutral = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: one, or the batch's."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    def alternatives(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(OpenAIRequest):
    """/v1/chat/completions: `messages` (validated into what the template gets), `logprobs` true or
    false with `top_logprobs`, and `tools` / `tool_choice` / `parallel_tool_calls`, which the handler
    negotiates with the chat template."""

    messages: Annotated[Any, PlainValidator(_messages, json_schema_input_type=list[dict[str, Any]])] = Field(
        None, validate_default=True)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# Every parameter name a refusal may point at (`param`).
PARAMETERS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)

# pydantic's error types for the strict fields above, in the words this server has always used.
MESSAGES = {
    "int_type": "'{name}' must be an integer, got {value!r}",
    "float_type": "'{name}' must be a number, got {value!r}",
    "finite_number": "'{name}' must be a finite number, got {value!r}",
    "bool_type": "'{name}' must be true or false, got {value!r}",
    "string_type": "'{name}' must be a string, got {value!r}",
}
BOUNDS = ("greater_than_equal", "less_than_equal", "greater_than", "less_than")
# Of several faulty parameters, these are named first, in this order (as the handlers checked them
# before the prompt's parameters); then the rest in the models' order.
FIRST = ("stream_options", "stream", "echo", "prompt", "messages")


def api_error(errors: Sequence[Any], model: type[OpenAIRequest], body: Any) -> ApiError:
    """The one OpenAI error (400) for a body `model` refused. Of several faults, a parameter the
    server does not implement is named first (in the body's order), then those of FIRST, as when they
    were checked one by one."""
    order = list(body) if isinstance(body, dict) else []

    def rank(item: tuple[int, Any]) -> tuple[int, int]:
        i, error = item
        name = _name(error)
        if error["type"] == "extra_forbidden" or (error.get("ctx") or {}).get("code") == "unsupported_parameter":
            return (0, order.index(name) if name in order else i)
        return (1, FIRST.index(name)) if name in FIRST else (2, i)

    error = min(enumerate(errors), key=rank)[1]
    name, value, ctx = _name(error), error.get("input"), error.get("ctx") or {}
    if error["type"] == REFUSED:
        return ApiError(400, ctx["message"], param=ctx.get("param", name), code=ctx.get("code"))
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"unknown or unsupported parameter {name!r}; this server takes "
                             f"{', '.join(model.taken())}", param=name, code="unsupported_parameter")
    if error["type"] in BOUNDS and name in model.model_fields:
        low, high = _bounds(model, name)
        return ApiError(400, f"'{name}' must be between {low} and {high}, got {value!r}", param=name)
    template = MESSAGES.get(error["type"], "'{name}' is not valid ({reason}), got {value!r}")
    return ApiError(400, template.format(name=name, value=value, reason=error.get("msg", ""))[:500], param=name)


def _name(error: Any) -> str | None:
    """The top-level parameter an error is about (FastAPI puts "body" first)."""
    loc = [part for part in error.get("loc", ()) if part != "body"]
    return str(loc[0]) if loc else None


def _bounds(model: type[OpenAIRequest], name: str) -> tuple[Any, Any]:
    low = high = None
    for rule in model.model_fields[name].metadata:
        low = getattr(rule, "ge", getattr(rule, "gt", low))
        high = getattr(rule, "le", getattr(rule, "lt", high))
    return low, high
