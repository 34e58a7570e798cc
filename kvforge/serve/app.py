"""`kvforge serve`: an OpenAI-compatible HTTP API over the continuous-batching scheduler.

FastAPI + uvicorn (the `serve` extra). Endpoints: POST /v1/completions, POST /v1/chat/completions
(streaming as server-sent events, or not), GET /v1/models, GET /health, GET /metrics (Prometheus
text; kvforge/serve/metrics.py, which also writes one log line per request on "kvforge.serve.app";
the line's id is the response's `id` and `x-request-id` header). Errors are OpenAI-shaped JSON,
{"error": {"message", "type", "param", "code"}}, whatever fails (a catch-all turns a bug into a 500
of that shape): 400 invalid or unsupported parameters or malformed JSON, 401 missing or wrong API key
(when one is set), 404 unknown model or path, 413 body over `max_body_bytes` or prompt over capacity,
415 a POST that is not `application/json`, 421 a Host that is not this server's, 429 queue full,
503 shutting down. A bad request never stops the server;
a client that goes away (streaming or not) cancels its request.

Hostile clients and files: the body is read up to `max_body_bytes` before anything else; parsing,
tokenizing and chat-template rendering run off the event loop (so /health keeps answering); the
template is read once at load and rendered in a killable child process with time and size limits
(runtime/chat_worker.py); the Host header is checked when `allowed_hosts` is given (`kvforge serve`
always gives it), against DNS rebinding; a POST must be `application/json`, so a web page cannot
send one without a CORS preflight. Sampling fields, log-probabilities, echo, prompt batches, n
choices and tool calls are read and written by kvforge/serve/choices.py (tool-call formats and
parsers: runtime/tool_calls.py; grammars: runtime/constraint.py).
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at runtime, and they are imported inside create_app.
import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvforge.core.errors import (
    BackendUnavailableError,
    CapacityError,
    InputError,
    KvforgeError,
    QueueFullError,
)
from kvforge.serve.guard import (  # noqa: F401  (re-exported: kvforge.serve.app's API)
    COMMON_FIELDS,
    DEFAULT_MAX_BODY_BYTES,
    DRAIN_BYTES,
    FIELDS,
    LOOPBACK_HOSTS,
    ApiError,
    Guard,
    allowed_hosts_for,
    check_api_key,
    check_fields,
    message_content,
    number_field,
    response_format_grammar,
    valid_text,
)

NON_STREAM_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests logged and counted


def _require():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError("kvforge serve needs FastAPI, uvicorn and prometheus-client: "
                                      "pip install 'kvforge[serve]'") from err


def create_app(export_dir: str | Path, *, max_batch: int = 8, max_seq_len: int | None = None,
               api_key: str | None = None, model_name: str | None = None, prefill_chunk: int = 128,
               max_queue: int = 64, threads: int | None = None, spinning: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Iterable[str] | None = None,
               template_seconds: float | None = None, chat_template: str | Path | None = None,
               backend: str | None = None, engine_dir: str | Path | None = None):
    """The FastAPI app serving one export (also what the Ray Serve deployment wraps).
    `spinning=False`: ONNX Runtime's threads sleep while they wait (a CPU shared with other busy processes);
    `allowed_hosts`: Host names answered (None: any; `kvforge serve` passes allowed_hosts_for());
    `template_seconds`: the time one chat-template rendering may take; `chat_template`: a Jinja file
    (or a built-in name, runtime/chat.py's BUILTIN_TEMPLATES) used instead of the export's."""
    _require()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.chat import chat_template_override, check_messages
    from kvforge.runtime.chat_worker import RENDER_SECONDS, IsolatedRenderer
    from kvforge.runtime.constraint import compiler_for
    from kvforge.runtime.request import FinishReason
    from kvforge.runtime.scheduler import Delta, Done, Scheduler
    from kvforge.runtime.tool_calls import ToolRequest, check_tool_support, detect_format, tool_request
    from kvforge.serve.choices import (
        Job,
        Reply,
        Tally,
        TokenPieces,
        completion_prompts,
        logprobs_option,
        sampling_options,
        speculate_option,
    )
    from kvforge.serve.metrics import RequestTrace, ServerMetrics

    check_api_key(api_key)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
        raise InputError(f"max_body_bytes must be an integer of at least 1024, got {max_body_bytes!r}")
    options: dict[str, Any] = {"threads": threads} if threads is not None else {}
    if not spinning:  # only given when asked: backends other than ONNX Runtime's take no such option
        options["spinning"] = False
    if engine_dir is not None:
        options["engine_dir"] = engine_dir
    generator = Generator(export_dir, backend=backend, **options)
    # A template given in place of the export's: one that cannot be read fails the start.
    override = (chat_template_override(chat_template, generator.folder, generator.manifest)
                if chat_template is not None else None)
    scheduler = Scheduler(generator, max_batch=max_batch, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                          max_queue=max_queue).start()
    name = model_name or Path(export_dir).resolve().name
    created = int(time.time())
    capacity = scheduler.capacity
    tokenizer = generator.tokenizer
    # No prompt of more characters than this can fit: a token never covers more characters than
    # its vocabulary string (x2 for normalizers that drop characters). Longer ones are refused
    # before they are tokenized.
    longest = max(map(len, tokenizer._tok.get_vocab(with_added_tokens=True)), default=1) if tokenizer else 1
    max_prompt_chars = capacity * max(longest, 1) * 2 + 1024
    template_error: KvforgeError | None = None
    try:
        template = generator.chat_template if override is None or tokenizer is None else override
    except KvforgeError as err:  # no template (or a broken one): chat requests get this message
        template, template_error = None, err
    pieces = TokenPieces(tokenizer)  # token texts and bytes for log-probabilities
    renderer = (IsolatedRenderer(template, seconds=template_seconds or RENDER_SECONDS).start()
                if template is not None else None)
    # How the template writes tool calls (None: it takes no tools, or kvforge does not parse its format).
    tool_format = detect_format(template.text, renderer.render) if renderer is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        scheduler.close()
        if renderer is not None:
            renderer.close()

    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.generator = generator
    app.state.renderer = renderer
    metrics = app.state.metrics = ServerMetrics(scheduler)

    def guard_refused(path: str, status: int, message: str) -> None:  # 401/413/415/421 before routing
        if path in GENERATION_PATHS:
            metrics.refused(path, status, message)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, on_refuse=guard_refused,
                       allowed_hosts=None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        # The id of the log line, for a refused request whose body carries none.
        rid = getattr(request.state, "request_id", None)
        return JSONResponse(err.body(), status_code=err.status, headers={"x-request-id": rid} if rid else None)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, err: HTTPException):  # 404 / 405 in OpenAI's shape too
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(err.status_code, str(err.detail), kind=kind).body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception):  # a bug: still JSON, never a plain-text page
        message = f"internal error: {type(err).__name__}: {err}"[:500]
        return JSONResponse(ApiError(500, message, kind="server_error").body(), status_code=500)

    def _parse(raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply to parse; send a flatter JSON object") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {name!r}", param="model",
                           code="model_not_found")
        return body

    def _too_long(what: str, size: str) -> ApiError:
        return ApiError(413, f"{what} ({size}) does not fit this server's context of {capacity} tokens; shorten it",
                        param="messages" if "conversation" in what else "prompt", code="context_length_exceeded")

    def _encode(text: str, special: bool, what: str) -> list[int]:
        assert tokenizer is not None
        if len(text) > max_prompt_chars:
            raise _too_long(what, f"{len(text)} characters")
        try:
            ids = tokenizer.encode(text, add_special_tokens=special)
        except KvforgeError as err:
            raise ApiError(400, str(err), param="prompt") from err
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 (the tokenizer's Rust panics are BaseExceptions)
            raise ApiError(400, f"the tokenizer could not encode {what}: {type(err).__name__}: {err}"[:300],
                           param="prompt") from None
        if len(ids) > capacity:
            raise _too_long(what, f"{len(ids)} tokens")
        return ids

    def _generation_request(body: dict, prompt_ids: list[int], default_max: int, kind: str,
                            constraint: Any = None) -> GenerationRequest | None:
        """The one request type, from OpenAI's parameters (Generator.request resolves the sampling);
        None for completions' max_tokens 0 (the prompt is only scored, after it is checked the same).
        `constraint`: the grammar of a forced tool call."""
        low = 0 if kind == "text" else 1
        max_tokens = number_field(body, "max_tokens", None, int, low, capacity)
        if max_tokens is None:
            max_tokens = number_field(body, "max_completion_tokens", default_max, int, low, capacity)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        for s in stop or []:
            valid_text(s, "'stop'", "stop")
        options = sampling_options(body, kind, generator.default_sampling.greedy)
        options.update(speculate_option(body, options))
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
        grammar = response_format_grammar(body.get("response_format"))
        if grammar is not None:
            try:  # compiled here, off the event loop; the scheduler's rows then copy the cached result
                compiler_for(generator.vocabulary).compile(grammar)
            except InputError as err:
                raise ApiError(400, str(err), param="response_format") from err
        if constraint is not None:
            if grammar is not None:
                raise ApiError(400, "'response_format' cannot be combined with a forced tool call (tool_choice "
                                    "'required' or a named function): the answer is the call", param="response_format")
            grammar = constraint
        try:
            checked = generator.request(prompt_ids, max(max_tokens, 1), stop=stop, grammar=grammar, ignore_eos=ignore_eos,
                                        **options)
        except InputError as err:
            raise ApiError(400, str(err)) from err
        return checked if max_tokens else None

    def _stream_flag(body: dict) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
        return stream

    def _prepare_completion(raw: bytes) -> tuple[list[Job], bool, dict, None]:
        """Parse, check and tokenize a completion request, and score the prompts that `echo` asks
        log-probabilities for (in a worker thread, off the event loop). One Job per prompt."""
        body = _parse(raw)
        check_fields(body, "text")
        stream = _stream_flag(body)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ApiError(400, f"'echo' must be true or false, got {echo!r}", param="echo")
        jobs = []
        for prompt in completion_prompts(body.get("prompt"), scheduler.max_queue):
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ApiError(400, "this export has no tokenizer: send 'prompt' as token ids", param="prompt")
                ids = _encode(valid_text(prompt, "'prompt'", "prompt"), True, "the prompt")
            else:
                if len(prompt) > capacity:
                    raise _too_long("the prompt", f"{len(prompt)} tokens")
                ids = list(prompt)
            generation = _generation_request(body, ids, 16, "text")  # OpenAI's completions default: 16 tokens
            job = Job(ids, generation)
            if echo:
                job.echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids) if tokenizer else ""
                top = logprobs_option(body, "text")
                if top is not None:
                    try:
                        job.prompt_logprobs = generator.prompt_logprobs(ids, top)
                    except InputError as err:
                        raise ApiError(400, str(err), param="prompt") from err
            jobs.append(job)
        return jobs, stream, body, None

    def _prepare_chat(raw: bytes) -> tuple[list[Job], bool, dict, ToolRequest | None]:
        """Parse, check, render (in the template's child process) and tokenize a chat request."""
        body = _parse(raw)
        check_fields(body, "chat")
        stream = _stream_flag(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        if renderer is None:
            raise ApiError(400, str(template_error), param="messages")
        messages = [dict(m, content=message_content(m.get("content"), i)) if isinstance(m, dict) else m
                    for i, m in enumerate(messages)]
        try:
            checked = check_messages(messages)
        except InputError as err:
            raise ApiError(400, str(err), param="messages") from err
        try:
            tools = tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                                 template.text, tool_format, template.source)
            if any("tool_calls" in m for m in checked):  # a template that ignores them would drop them
                check_tool_support(template.text, tool_format, template.source)
        except InputError as err:
            raise ApiError(400, str(err), param="tools") from err
        chars = 0
        for i, message in enumerate(checked):
            for key in ("role", "content"):
                valid_text(message[key], f"messages[{i}].{key}", "messages")
            chars += len(message["content"])
        if chars > max_prompt_chars:
            raise _too_long("the conversation", f"{chars} characters")
        try:
            text = renderer.render(checked, True, tools.template_tools if tools is not None else None)
        except InputError as err:
            raise ApiError(400, str(err), param="messages", code="chat_template_error") from err
        ids = _encode(valid_text(text, "the rendered conversation", "messages"), False, "the conversation")
        constraint = _tool_grammar(tools)
        # Without max_tokens a chat answer may use the rest of the context, as OpenAI's does.
        generation = _generation_request(body, ids, max(1, capacity - len(ids) + 1), "chat", constraint)
        return [Job(ids, generation)], stream, body, tools

    def _tool_grammar(tools: ToolRequest | None) -> Any:
        """The grammar forcing a call (tool_choice "required" or a named function), compiled now so
        that parameters no grammar can be made of are a 400 with llguidance's message."""
        try:
            constraint = tools.grammar() if tools is not None else None
            if constraint is not None:
                compiler_for(generator.vocabulary).compile(constraint)
        except InputError as err:
            raise ApiError(400, f"the tools' parameters cannot be enforced: {err}", param="tools") from err
        return constraint

    async def _prepare(request: Request, prepare: Callable[[bytes], Any]) -> Any:
        raw = await request.body()
        return await asyncio.to_thread(prepare, raw)

    def _submit(jobs: list[Job], put: Callable[[int, Any], None]) -> list[Any]:
        """Queue every job's request (all or none): their handles."""
        handles = []
        try:
            for p, job in enumerate(jobs):
                if job.request is not None:
                    handles.append(scheduler.submit(job.request, on_event=lambda e, p=p: put(p, e)))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def _run(request: Request, jobs: list[Job], stream: bool, body: dict, kind: str, trace: RequestTrace,
                   tools: ToolRequest | None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        rid = trace.id
        trace.stream = stream

        tally = Tally(jobs, number_field(body, "n", 1, int))  # the one Done the log line and metrics take

        def on_event(p: int, event: Delta | Done) -> None:  # in the scheduler thread
            # Timings first: the handler may log as soon as it sees the last Done.
            if isinstance(event, Delta):
                trace.on_event(event, stream=(p, event.index))
            elif tally.add(event) is not None:
                trace.on_event(tally.done)
            loop.call_soon_threadsafe(events.put_nowait, (p, event))

        try:
            handles = _submit(jobs, on_event)
        except QueueFullError as err:
            raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from err
        except CapacityError as err:
            raise ApiError(413, str(err), param="max_tokens", code="context_length_exceeded") from err
        except InputError as err:
            raise ApiError(400, str(err)) from err
        except KvforgeError as err:
            raise ApiError(503, str(err), kind="server_error") from err
        if not handles:  # nothing to generate (max_tokens 0): the request has ended already
            trace.on_event(tally.done)
        reply = Reply(kind, rid, name, jobs, pieces, number_field(body, "n", 1, int), logprobs_option(body, kind),
                      tools)

        def cancel_all() -> None:
            for handle in handles:
                handle.cancel()  # the client went away (or we are done: then a no-op)

        if stream:
            async def sse():
                try:
                    for chunk in reply.opening():
                        yield f"data: {json.dumps(chunk)}\n\n"
                    while not reply.finished:
                        p, event = await events.get()
                        if isinstance(event, Done) and event.finish_reason == FinishReason.ERROR:
                            yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                            break
                        for chunk in reply.add(p, event):
                            yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    cancel_all()
                    trace.end(200)  # logged now, or once the cancelled request's last Done comes

            return StreamingResponse(sse(), media_type="text/event-stream", headers={"x-request-id": rid})

        getter = asyncio.ensure_future(events.get())
        checked = time.monotonic()
        status = 499  # unless it ends: the client went away
        try:
            while not reply.finished:
                # One pending get() (never cancelled, so no event is lost), and every
                # NON_STREAM_POLL_S a check that the client is still there: a gone client's
                # generation is cancelled.
                done, _ = await asyncio.wait({getter}, timeout=NON_STREAM_POLL_S)
                if time.monotonic() - checked >= NON_STREAM_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return JSONResponse(ApiError(499, "the client closed the connection").body(), status_code=499)
                if not done:
                    continue
                p, event = getter.result()
                if isinstance(event, Done) and event.finish_reason == FinishReason.ERROR:
                    status = 500
                    raise ApiError(500, event.error or "generation failed", kind="server_error")
                reply.add(p, event)
                getter = asyncio.ensure_future(events.get())
            status = 200
        finally:
            getter.cancel()
            cancel_all()
            trace.end(status)  # logged now, or once a cancelled request's last Done comes
        return reply.body()

    async def _serve(request: Request, prepare: Callable[[bytes], Any], kind: str):
        """Prepare and run one request, with its log line and metrics (refusals included)."""
        path, prefix = GENERATION_PATHS[kind == "chat"], "chatcmpl" if kind == "chat" else "cmpl"
        trace = metrics.trace(path, f"{prefix}-{uuid.uuid4().hex}")
        request.state.request_id = trace.id
        try:
            jobs, stream, body, tools = await _prepare(request, prepare)
            response = await _run(request, jobs, stream, body, kind, trace, tools)
        except ApiError as err:
            trace.refuse(err.status, err.message)  # a no-op when the request ran (500: already logged)
            raise
        except Exception as err:
            trace.refuse(500, f"internal error: {type(err).__name__}: {err}")
            raise
        if not isinstance(response, Response):
            response = JSONResponse(response, headers={"x-request-id": trace.id})
        return response

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, _prepare_completion, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, _prepare_chat, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvforge"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one InputError saying why not (busy port, bad host):
    bound before the model loads and before "serving on ..." is said."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise InputError(f"cannot serve on --host {host!r}: not an address or a name this machine resolves "
                         f"({getattr(err, 'strerror', None) or err}); use e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        hint = ("another process is listening there: stop it or pick another --port"
                if err.errno in (98, 48) else "check --host (an address of this machine) and --port")
        raise InputError(f"cannot listen on {host}:{port}: {err.strerror or err}; {hint}") from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(config: Any) -> Any:
    """uvicorn's Server, with SIGINT and SIGTERM recorded in `stop_signal` (and not re-raised after
    the graceful shutdown, as uvicorn does), so that `kvforge serve` exits 130 on Ctrl-C and 0 on
    SIGTERM instead of dying by the signal."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_signal: int | None = None

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
            super().handle_exit(sig, frame)  # a second Ctrl-C forces the exit

    return Server(config)


def serve(export_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          ready: Callable[[str], None] | None = None, allow_hosts: Iterable[str] = (),
          sock: socket.socket | None = None, log_format: str = "text", **options: Any) -> int | None:
    """Run the app with uvicorn until SIGINT or SIGTERM; returns the signal that stopped it.
    The app is built (a bad export fails first), then the socket bound (or `sock` taken: a busy
    port or a bad host is an InputError), and only then is `ready(url)` called. `log_format`:
    the request log on stderr, "text" (key=value), "json" (one object a line) or "off"."""
    _require()
    import logging

    import uvicorn

    from kvforge.serve.metrics import LOGGER, request_log_handler

    handler = request_log_handler(log_format)

    app = create_app(export_dir, allowed_hosts=allowed_hosts_for(host, allow_hosts), **options)
    try:
        sock = sock if sock is not None else bind_socket(host, port)
    except InputError:
        app.state.scheduler.close()  # uvicorn never ran, so its lifespan will not stop them
        if app.state.renderer is not None:
            app.state.renderer.close()
        raise
    if handler is not None:
        LOGGER.addHandler(handler)
        if not LOGGER.isEnabledFor(logging.INFO):
            LOGGER.setLevel(logging.INFO)
    try:
        bound_port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        if ready is not None:
            ready(f"http://{shown}:{bound_port}/v1")
        # A stream still open 5 s after Ctrl-C / SIGTERM is cut: a stop request always stops.
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        server = _uvicorn_server(config)
        server.run(sockets=[sock])
        return server.stop_signal
    finally:
        sock.close()
        if handler is not None:
            LOGGER.removeHandler(handler)
