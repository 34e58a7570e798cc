"""The OpenAI-compatible endpoints over a GenerationService (runtime/service.py): a request body, decoded
here and validated by FastAPI against its model (kvforge/serve/protocol.py), is checked against the
loaded export, turned into GenerationRequests (the OpenAI -> request mapping lives here, once), run on
the scheduler and answered as JSON or server-sent events. kvforge/serve/app.py wires them into FastAPI;
the preparation steps take a validated model and return plain data, so they are tested without HTTP.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations at runtime.
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvforge.core.errors import CapacityError, InputError, KvforgeError, QueueFullError
from kvforge.runtime.controls.request import FinishReason, GenerationRequest
from kvforge.runtime.controls.tool_calls import ToolRequest
from kvforge.runtime.drivers.handles import Delta, Done
from kvforge.runtime.service import GenerationService, TemplateError
from kvforge.serve import speculation
from kvforge.serve.choices import Job, Reply, Tally, sampling_options
from kvforge.serve.guard import ApiError, decode_body, within
from kvforge.serve.metrics import RequestTrace, ServerMetrics
from kvforge.serve.protocol import PARAMETERS, ChatCompletionRequest, CompletionRequest, OpenAIRequest

# Requests are prepared (parsed, tokenized, chats rendered) on bounded pools, never on the event loop:
# large prompts cannot take every core from /health, and completions never queue behind chats waiting
# for the template's child process (one render at a time; a looping template takes its timeout each).
PREPARE_WORKERS = {"text": 2, "chat": 2}
NON_STREAM_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests logged and counted


@dataclass
class Prepared:
    """A prepared request: one Job per prompt (chat: one), the stream flag, the body, its tools."""

    jobs: list[Job]
    stream: bool
    body: OpenAIRequest
    tools: ToolRequest | None = None


class OpenAIHandlers:
    """/v1/completions, /v1/chat/completions, /v1/models and /health for one served export `name`."""

    def __init__(self, service: GenerationService, name: str, metrics: ServerMetrics) -> None:
        self.service = service
        self.name = name
        self.metrics = metrics
        self.created = int(time.time())
        self.pools = {kind: ThreadPoolExecutor(workers, thread_name_prefix=f"kvforge-prepare-{kind}")
                      for kind, workers in PREPARE_WORKERS.items()}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # -- preparation (in a worker thread, off the event loop) --------------------------------------
    # The body was validated by FastAPI against its model (kvforge/serve/protocol.py); what is checked
    # here needs the loaded export: the served name, the context, the vocabulary, the queue, the template.
    def check_model(self, body: dict[str, Any]) -> None:
        """A 404 for a body naming another model (before its parameters are validated, as OpenAI does)."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.name!r}", param="model",
                           code="model_not_found")

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        """Tokenize and check a completion request's prompts, and score the prompts that `echo` asks
        log-probabilities for. One Job per prompt."""
        prompts = body.prompts()
        if len(prompts) > self.service.max_queue:
            raise ApiError(400, f"'prompt' holds {len(prompts)} prompts; this server takes at most "
                                f"{self.service.max_queue} per request (its queue length): split the batch",
                           param="prompt")
        jobs = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = self._encode(prompt, True, "the prompt", "prompt")
            else:
                ids = self._fits(list(prompt), "the prompt", "prompt")
                try:
                    self.service.check_ids(ids)
                except InputError as err:
                    raise ApiError(400, str(err), param="prompt") from err
            job = Job(ids, self.generation_request(body, ids, 16))  # OpenAI's completions default: 16
            if body.echo:
                job.echo = prompt if isinstance(prompt, str) else self.service.decode(ids)
                top = body.alternatives()
                if top is not None:
                    try:
                        job.prompt_logprobs = self.service.prompt_logprobs(ids, top)
                    except InputError as err:
                        raise ApiError(400, str(err), param="prompt") from err
            jobs.append(job)
        return Prepared(jobs, body.stream, body)

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        """Render (in the template's child process) and tokenize a chat request's messages."""
        if self.service.renderer is None:
            raise ApiError(400, str(self.service.template_error), param="messages")
        try:
            tools = self.service.tools(body.tools, body.tool_choice, body.parallel_tool_calls, body.messages)
        except InputError as err:
            raise ApiError(400, str(err), param="tools") from err
        try:
            ids, images = self.service.conversation_with_images(body.messages, tools)
        except TemplateError as err:
            raise ApiError(400, str(err), param="messages", code="chat_template_error") from err
        except CapacityError as err:
            raise ApiError(413, str(err), param="messages", code="context_length_exceeded") from err
        except InputError as err:
            raise ApiError(400, str(err), param="messages") from err
        if not ids:  # the server's template at fault, not the client's messages
            raise ApiError(500, "the server's chat template rendered these messages to no text (no tokens), so there "
                           "is no prompt to answer; the server's operator can give another with kvforge serve "
                           "--chat-template FILE", kind="server_error", code="chat_template_error")
        constraint = self._tool_grammar(tools)
        # Without max_tokens a chat answer may use the rest of the context, as OpenAI's does.
        length = self.service.export.images.prompt_length(ids, images) if images else len(ids)
        generation = self.generation_request(body, ids, max(1, self.service.capacity - length + 1), constraint,
                                             images)
        return Prepared([Job(ids, generation, positions=length)], body.stream, body, tools)

    def generation_request(self, body: OpenAIRequest, prompt_ids: list[int], default_max: int,
                           constraint: Any = None, images: list[Any] | None = None) -> GenerationRequest | None:
        """The one request type from OpenAI's parameters (the Generator resolves the sampling); None for
        completions' max_tokens 0 (the prompt is only scored, after it is checked the same).
        `constraint`: the grammar of a forced tool call."""
        low = 0 if isinstance(body, CompletionRequest) else 1
        max_tokens = default_max
        for name in ("max_tokens", "max_completion_tokens"):  # the first one given
            if getattr(body, name) is not None:
                max_tokens = within(name, getattr(body, name), low, self.service.capacity)
                break
        options = sampling_options(body, self.service.default_greedy)
        options.update(speculation.request_options(body, self.service.export, self.service.draft_len))
        grammar = body.response_format  # validated into a Grammar; compiling it needs the vocabulary
        if grammar is not None:
            try:
                self.service.check_grammar(grammar)
            except InputError as err:
                raise ApiError(400, str(err), param="response_format") from err
        if constraint is not None:
            if grammar is not None:
                raise ApiError(400, "'response_format' cannot be combined with a forced tool call (tool_choice "
                                    "'required' or a named function): the answer is the call", param="response_format")
            grammar = constraint
        try:
            request = self.service.request(prompt_ids, max(max_tokens, 1), stop=body.stop, grammar=grammar,
                                           ignore_eos=body.ignore_eos, images=images or None, **options)
        except InputError as err:
            raise ApiError(400, str(err), param=_param_of(err)) from err
        return request if max_tokens else None

    def _encode(self, text: str, special: bool, what: str, param: str) -> list[int]:
        try:
            return self.service.encode(text, special, what)
        except CapacityError as err:
            raise ApiError(413, str(err), param=param, code="context_length_exceeded") from err
        except InputError as err:
            raise ApiError(400, str(err), param=param) from err

    def _fits(self, ids: list[int], what: str, param: str) -> list[int]:
        try:
            self.service.check_length(ids, what)
        except CapacityError as err:
            raise ApiError(413, str(err), param=param, code="context_length_exceeded") from err
        return ids

    def _tool_grammar(self, tools: ToolRequest | None) -> Any:
        """The grammar forcing a call (tool_choice "required" or a named function), compiled now so that
        parameters no grammar can be made of are a 400 with llguidance's message."""
        try:
            constraint = tools.grammar() if tools is not None else None
            if constraint is not None:
                self.service.check_grammar(constraint)
        except InputError as err:
            raise ApiError(400, f"the tools' parameters cannot be enforced: {err}", param="tools") from err
        return constraint

    # -- running --------------------------------------------------------------------------------------
    async def traced(self, request: Any, kind: str,
                     respond: Callable[[bytes, dict[str, Any]], Awaitable[Any]]) -> Any:
        """One generation request from its arrival, with its id, its log line and its metrics (refusals
        included): the body read and decoded (on the prepare pool: parsing is not free), then
        `respond(raw, body)`: FastAPI's route, whose dependency validates the body, then serve()."""
        path, prefix = GENERATION_PATHS[kind == "chat"], "chatcmpl" if kind == "chat" else "cmpl"
        trace = self.metrics.trace(path, f"{prefix}-{uuid.uuid4().hex}")
        request.state.request_id, request.state.trace = trace.id, trace
        try:
            raw = await request.body()
            body = await asyncio.get_running_loop().run_in_executor(self.pools[kind], decode_body, raw)
            return await respond(raw, body)
        except ApiError as err:
            trace.refuse(err.status, err.message)  # a no-op when the request ran (500: already logged)
            raise
        except Exception as err:
            trace.refuse(500, f"internal error: {type(err).__name__}: {err}")
            raise

    async def serve(self, request: Any, body: OpenAIRequest) -> Any:
        """Prepare (on the prepare pool) and run one validated request."""
        from fastapi.responses import JSONResponse, Response

        kind, trace = "chat" if isinstance(body, ChatCompletionRequest) else "text", request.state.trace
        prepare = self.prepare_chat if kind == "chat" else self.prepare_completion
        prepared = await asyncio.get_running_loop().run_in_executor(self.pools[kind], prepare, body)
        response = await self.run(request, prepared, kind, trace)
        if not isinstance(response, Response):
            response = JSONResponse(response, headers={"x-request-id": trace.id})
        return response

    async def run(self, request: Any, prepared: Prepared, kind: str, trace: RequestTrace) -> Any:
        """Submit the prepared jobs and answer: server-sent events, or JSON once every choice is done. A
        client that goes away cancels its generations."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        trace.stream = prepared.stream
        trace.speculate = speculation.method_of([job.request for job in prepared.jobs], self.service.scheduler)
        n = prepared.body.choices
        tally = Tally(prepared.jobs, n)  # the one Done the log line and metrics take

        def on_event(p: int, event: Delta | Done) -> None:  # in the scheduler thread
            # Timings first: the handler may log as soon as it sees the last Done.
            if isinstance(event, Delta):
                trace.on_event(event, stream=(p, event.index))
            elif tally.add(event) is not None:
                trace.on_event(tally.done)
            loop.call_soon_threadsafe(events.put_nowait, (p, event))

        # On the prepare pool, not the event loop: queueing encodes a request's images and takes the scheduler's
        # lock, and /health must not wait for either.
        handles = await loop.run_in_executor(self.pools[kind], self._submit, prepared, on_event)
        if not handles:  # nothing to generate (max_tokens 0): the request has ended already
            trace.on_event(tally.done)
        reply = Reply(kind, trace.id, self.name, prepared.jobs, self.service.pieces, n,
                      prepared.body.alternatives(), prepared.tools)

        def cancel_all() -> None:
            for handle in handles:
                handle.cancel()  # the client went away (or we are done: then a no-op)

        if prepared.stream:
            return _event_stream(reply, events, cancel_all, trace)
        return await _answer(request, reply, events, cancel_all, trace)

    def _submit(self, prepared: Prepared, on_event: Callable[[int, Any], None]) -> list[Any]:
        try:
            return self.service.submit([job.request for job in prepared.jobs], on_event)
        except QueueFullError as err:
            raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from err
        except CapacityError as err:
            raise ApiError(413, str(err), param="max_tokens", code="context_length_exceeded") from err
        except InputError as err:
            raise ApiError(400, str(err)) from err
        except KvforgeError as err:
            raise ApiError(503, str(err), kind="server_error") from err

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "kvforge"}]}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.name}


def _event_stream(reply: Reply, events: asyncio.Queue, cancel_all: Callable[[], None], trace: RequestTrace) -> Any:
    from fastapi.responses import StreamingResponse

    async def sse():
        try:
            for chunk in reply.opening():
                yield f"data: {json.dumps(chunk)}\n\n"
            while not reply.finished:
                p, event = await events.get()
                if _failed(event):
                    yield f"data: {json.dumps(_generation_error(event).body())}\n\n"
                    break
                for chunk in reply.add(p, event):
                    yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            cancel_all()
            trace.end(200, tool_calls=reply.finished and reply.called_tools())  # logged now, or at the last Done

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"x-request-id": trace.id})


async def _answer(request: Any, reply: Reply, events: asyncio.Queue, cancel_all: Callable[[], None],
                  trace: RequestTrace) -> Any:
    """The JSON answer once every choice is done. One pending get() (never cancelled, so no event is lost),
    and every NON_STREAM_POLL_S a check that the client is still there: a gone client's generation is
    cancelled."""
    from fastapi.responses import JSONResponse

    getter = asyncio.ensure_future(events.get())
    checked = time.monotonic()
    status = 499  # unless it ends: the client went away
    try:
        while not reply.finished:
            done, _ = await asyncio.wait({getter}, timeout=NON_STREAM_POLL_S)
            if time.monotonic() - checked >= NON_STREAM_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return JSONResponse(ApiError(499, "the client closed the connection").body(), status_code=499)
            if not done:
                continue
            p, event = getter.result()
            if _failed(event):
                error = _generation_error(event)
                status = error.status
                raise error
            reply.add(p, event)
            getter = asyncio.ensure_future(events.get())
        status = 200
    finally:
        getter.cancel()
        cancel_all()
        trace.end(status, tool_calls=status == 200 and reply.called_tools())  # logged now, or at the last Done
    return reply.body()


def _param_of(err: InputError) -> str | None:
    """The OpenAI parameter a request's own check names ("stop must be ...", "ignore_eos ...")."""
    word = str(err).split(" ", 1)[0].strip("'")
    return word if word in PARAMETERS | {"draft_len"} else None


def _failed(event: Delta | Done) -> bool:
    """A Done that ends the request with an error: the backend's or its grammar's, or the server's cut
    at shutdown (a CANCELLED with a message; a client's own cancel has none)."""
    return isinstance(event, Done) and (event.finish_reason == FinishReason.ERROR
                                        or (event.finish_reason == FinishReason.CANCELLED and event.error is not None))


def _generation_error(done: Done) -> ApiError:
    """The error a failed generation answers: 400 when the request's own grammar failed (its other
    choices and every other request went on), 503 when the server cut it on shutdown, 500 when the
    server failed."""
    if done.finish_reason == FinishReason.CANCELLED:
        return ApiError(503, done.error or "the server is shutting down", kind="server_error",
                        code="server_shutting_down")
    if done.client_error:
        return ApiError(400, done.error or "the request's grammar failed",
                        code="grammar_failed")
    return ApiError(500, done.error or "generation failed", kind="server_error")
