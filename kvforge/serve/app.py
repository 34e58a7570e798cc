"""`kvforge serve`: an OpenAI-compatible HTTP API over the continuous-batching scheduler.

FastAPI + uvicorn (the `serve` extra). Endpoints: POST /v1/completions, POST /v1/chat/completions
(streaming as server-sent events, or not), GET /v1/models, GET /health, GET /metrics (Prometheus
text; kvforge/serve/metrics.py, which also writes one log line per request on the "kvforge.serve" logger;
the line's id is the response's `id` and `x-request-id` header). Errors are OpenAI-shaped JSON,
{"error": {"message", "type", "param", "code"}}, whatever fails (a catch-all turns a bug into a 500
of that shape): 400 invalid or unsupported parameters or malformed JSON, 401 missing or wrong API key
(when one is set), 404 unknown model or path, 413 body over `max_body_bytes` or prompt over capacity,
415 a POST that is not `application/json`, 421 a Host that is not this server's, 429 queue full,
503 shutting down. A bad request never stops the server;
a client that goes away (streaming or not) cancels its request.

Hostile clients and files: the body is read up to `max_body_bytes` before anything else; parsing,
validating, tokenizing and chat-template rendering run off the event loop (so /health keeps answering); the
template is read once at load and rendered in a killable child process with time and size limits
(runtime/text/chat_worker.py); the Host header is checked when `allowed_hosts` is given (`kvforge serve`
always gives it), against DNS rebinding; a POST must be `application/json`, so a web page cannot
send one without a CORS preflight.

The layers of a request: this module wires FastAPI (routes, the Guard middleware of
kvforge/serve/guard.py, OpenAI-shaped errors); kvforge/serve/protocol.py's pydantic models validate
each body once; kvforge/serve/handlers.py turns OpenAI's parameters into
GenerationRequests and answers (choices, log-probabilities, echo, prompt batches, n and tool calls:
kvforge/serve/choices.py); runtime/service.py holds the export's side (tokenizing within the context,
the chat template in its child process, tools, grammars, the Scheduler).
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at runtime, and they are imported inside create_app.
import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

from kvforge.core.errors import (
    BackendUnavailableError,
    InputError,
)
from kvforge.serve.guard import (  # noqa: F401  (re-exported: kvforge.serve.app's API)
    DEFAULT_MAX_BODY_BYTES,
    DRAIN_BYTES,
    LOOPBACK_HOSTS,
    ApiError,
    Guard,
    allowed_hosts_for,
    answer_errors_as_json,
    check_api_key,
)


def _require():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError("kvforge serve needs FastAPI, uvicorn and prometheus-client: "
                                      "pip install -e '.[serve]'") from err


def create_app(export_dir: str | Path, *, max_batch: int = 8, max_seq_len: int | None = None,
               api_key: str | None = None, model_name: str | None = None, prefill_chunk: int = 128,
               max_queue: int = 64, threads: int | None = None, spinning: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Iterable[str] | None = None,
               template_seconds: float | None = None, chat_template: str | Path | None = None,
               backend: str | None = None, engine_dir: str | Path | None = None,
               special_tokens_in_content: bool = False, speculate: str | None = None,
               draft: str | Path | None = None, draft_len: int = 6, adaptive_draft: bool = True,
               max_audio_bytes: int = 25 << 20, max_audio_seconds: float = 1800.0):
    """The FastAPI app serving one export (also what the Ray Serve deployment wraps): the export's
    LoadedExport in a GenerationService (runtime/service.py), the OpenAI handlers over it
    (kvforge/serve/handlers.py), the Guard middleware and the metrics. `spinning=False`: ONNX Runtime's
    threads sleep while they wait (a CPU shared with other busy processes); `allowed_hosts`: Host names
    answered (None: any; `kvforge serve` passes allowed_hosts_for()); `template_seconds`: the time one chat-
    template rendering may take; `chat_template`: a Jinja file (or a built-in name, runtime/text/chat.py's
    BUILTIN_TEMPLATES) used instead of the export's; `special_tokens_in_content`: special-token text in chat
    messages becomes control tokens (trusted clients only; by default it stays text). `speculate`,
    `draft_len`: the speculation of requests that name none; `draft`: the draft export of method draft;
    `adaptive_draft`: draft lengths follow acceptance (kvforge/serve/speculation.py). An encoder-decoder
    export: kvforge/serve/speech.py's app, with its upload limits."""
    _require()
    unread = {"--max-seq-len": max_seq_len, "--template-seconds": template_seconds, "--chat-template": chat_template,
              "--backend": backend if backend not in (None, "ort-cpu") else None, "--engine-dir": engine_dir,
              "--special-tokens-in-content": special_tokens_in_content or None, "--speculate": speculate,
              "--draft": draft, "--prefill-chunk": prefill_chunk if prefill_chunk != 128 else None,
              "--max-body-bytes": max_body_bytes if max_body_bytes != DEFAULT_MAX_BODY_BYTES else None}
    if (seq2seq := _encoder_decoder_app(export_dir, unread, api_key=api_key, model_name=model_name, threads=threads,
                                        allowed_hosts=allowed_hosts, max_audio_bytes=max_audio_bytes,
                                        max_audio_seconds=max_audio_seconds, max_batch=max_batch,
                                        max_queue=max_queue, spinning=spinning)) is not None:
        return seq2seq
    from fastapi import FastAPI

    from kvforge.runtime import LoadedExport
    from kvforge.runtime.drivers.speculation_checks import target_options
    from kvforge.runtime.service import GenerationService
    from kvforge.serve.handlers import GENERATION_PATHS, OpenAIHandlers
    from kvforge.serve.metrics import ServerMetrics
    from kvforge.serve.speculation import scheduler_options

    check_api_key(api_key)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
        raise InputError(f"max_body_bytes must be an integer of at least 1024, got {max_body_bytes!r}")
    options = {key: value for key, value in (("threads", threads), ("engine_dir", engine_dir),  # only those given
                                             ("spinning", None if spinning else False)) if value is not None}
    export = LoadedExport(export_dir, backend=backend, **target_options(export_dir, backend, speculate, options))
    speculation = scheduler_options(export, speculate, draft, draft_len, adaptive_draft,
                                    **({"threads": threads} if threads is not None else {}))
    service = GenerationService(export, max_batch=max_batch, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                                max_queue=max_queue,
                                chat_template=chat_template, template_seconds=template_seconds,
                                special_tokens_in_content=special_tokens_in_content, **speculation)
    metrics = ServerMetrics(service.scheduler)
    handlers = OpenAIHandlers(service, model_name or Path(export_dir).resolve().name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        handlers.close()
        service.close()

    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.service, app.state.metrics, app.state.handlers = service, metrics, handlers
    app.state.scheduler, app.state.export, app.state.renderer = service.scheduler, service.export, service.renderer

    def guard_refused(path: str, status: int, message: str) -> None:  # 401/413/415/421 before routing
        if path in GENERATION_PATHS:
            metrics.refused(path, status, message)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, on_refuse=guard_refused,
                       allowed_hosts=None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts))

    answer_errors_as_json(app)
    app.include_router(_generation_routes(handlers))

    _info_routes(app, handlers, metrics)
    return app


def _info_routes(app: Any, handlers: Any, metrics: Any) -> None:
    """GET /v1/models, /health and /metrics."""
    from fastapi.responses import Response

    @app.get("/v1/models")
    async def models():
        return handlers.models()

    @app.get("/health")
    async def health():
        return handlers.health()

    @app.get("/metrics")
    async def prometheus_metrics():
        # Off the event loop: the gauges take the scheduler's lock, and /health must not wait for it.
        body, content_type = await asyncio.get_running_loop().run_in_executor(None, metrics.exposition)
        return Response(body, media_type=content_type)


def _encoder_decoder_app(export_dir: str | Path, unread: dict[str, Any], **options: Any) -> Any:
    """An encoder-decoder export's app (kvforge/serve/speech.py), or None for any other export. `unread`: the
    decoder-only server's settings, by flag: any given is refused in one line (none applies to an encoder-decoder)."""
    from kvforge.core.encoder_contract import is_encoder_decoder

    if not is_encoder_decoder(export_dir):
        return None
    given = [flag for flag, value in unread.items() if value is not None]
    if given:
        raise InputError(f"{export_dir} is an encoder-decoder export: {', '.join(given)} does not apply to it "
                         "(its server batches on ONNX Runtime CPU, without speculation or chat templates)")
    from kvforge.serve.speech import create_seq2seq_app

    return create_seq2seq_app(export_dir, **options)


def _generation_routes(handlers: Any) -> Any:
    """POST /v1/completions and /v1/chat/completions. Each endpoint takes its pydantic model
    (kvforge/serve/protocol.py), validated once before the endpoint runs by a FastAPI dependency, on
    the prepare pool: pydantic takes 50-250 ms on the largest hostile bodies (2 MiB of token-id
    lists), which must not stall /health; the OpenAPI description shows the model as the body.
    Around FastAPI's own handler, the route (handlers.traced) gives the request its id and log line and
    decodes the body off the event loop (what FastAPI then reads as request.json()); another model's
    name is a 404 before the parameters are validated; a refused parameter is protocol.api_error's."""
    import asyncio

    from fastapi import APIRouter, Depends, Request
    from fastapi.routing import APIRoute
    from pydantic import ValidationError

    from kvforge.serve.handlers import GENERATION_PATHS
    from kvforge.serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest, api_error

    class Decoded(Request):
        """The request as FastAPI reads it: the body already read and decoded."""

        def __init__(self, request: Request, raw: bytes, body: dict[str, Any]) -> None:
            super().__init__(request.scope, request.receive)
            self._raw, self._decoded = raw, body

        async def body(self) -> bytes:
            return self._raw

        async def json(self) -> Any:
            return self._decoded

    class GenerationRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handle, kind = super().get_route_handler(), "chat" if self.path == GENERATION_PATHS[1] else "text"

            async def route(request: Request) -> Any:
                return await handlers.traced(request, kind, lambda raw, body: handle(Decoded(request, raw, body)))

            return route

    def validated(model: type[OpenAIRequest], kind: str) -> Any:
        async def dependency(request: Request) -> OpenAIRequest:
            body = await request.json()
            handlers.check_model(body)
            try:
                return await asyncio.get_running_loop().run_in_executor(handlers.pools[kind], model.model_validate,
                                                                        body)
            except ValidationError as err:
                raise api_error(err.errors(), model, body) from None

        return Depends(dependency)

    def described(model: type[OpenAIRequest]) -> dict[str, Any]:  # the body's schema in /openapi.json
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}

    router = APIRouter(route_class=GenerationRoute)

    @router.post(GENERATION_PATHS[0], openapi_extra=described(CompletionRequest))
    async def completions(request: Request, body: Annotated[CompletionRequest, validated(CompletionRequest, "text")]):
        return await handlers.serve(request, body)

    @router.post(GENERATION_PATHS[1], openapi_extra=described(ChatCompletionRequest))
    async def chat_completions(request: Request,
                               body: Annotated[ChatCompletionRequest, validated(ChatCompletionRequest, "chat")]):
        return await handlers.serve(request, body)

    return router


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


# A request still running this long after Ctrl-C / SIGTERM is cut: a stop request always stops. The
# server cuts them itself CUT_MARGIN_S before uvicorn would (uvicorn's cut answers a plain-text 500 and
# leaves no log line), so that each gets a JSON 503 (or a stream's error event) and its log line.
GRACEFUL_SHUTDOWN_S = 5.0
CUT_MARGIN_S = 1.0


def _uvicorn_server(config: Any, on_stop: Callable[[], None] = lambda: None) -> Any:
    """uvicorn's Server, with SIGINT and SIGTERM recorded in `stop_signal` (and not re-raised after
    the graceful shutdown, as uvicorn does), so that `kvforge serve` exits 130 on Ctrl-C and 0 on
    SIGTERM instead of dying by the signal; `on_stop()` is called at the first one."""
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
                on_stop()
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
        app.state.handlers.close()  # uvicorn never ran, so its lifespan will not stop them
        app.state.scheduler.close()
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
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        message = (f"the server is shutting down: requests still running {GRACEFUL_SHUTDOWN_S - CUT_MARGIN_S:g} s "
                   "after it was asked to stop are cut")
        cut = threading.Timer(GRACEFUL_SHUTDOWN_S - CUT_MARGIN_S, app.state.scheduler.cut, args=(message,))
        cut.daemon = True
        server = _uvicorn_server(config, on_stop=cut.start)
        server.run(sockets=[sock])
        return server.stop_signal
    finally:
        sock.close()
        if handler is not None:
            LOGGER.removeHandler(handler)
