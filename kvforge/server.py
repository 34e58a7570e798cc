"""`kvforge serve`: an OpenAI-compatible HTTP API over the continuous-batching scheduler.

FastAPI + uvicorn (the `serve` extra). Endpoints: POST /v1/completions, POST /v1/chat/completions
(streaming as server-sent events, or not), GET /v1/models, GET /health, GET /metrics (Prometheus
text). Errors are OpenAI-shaped JSON, {"error": {"message", "type", "param", "code"}}: 400 invalid
parameters or malformed JSON, 401 missing or wrong API key (when one is set), 404 unknown model,
413 prompt over capacity, 429 queue full, 503 shutting down. A bad request never stops the server;
a client that goes away mid-stream cancels its request.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request)
# at runtime, and they are imported inside create_app.
import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.errors import BackendUnavailableError, CapacityError, InputError, KvforgeError, QueueFullError


def _require():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError("kvforge serve needs FastAPI and uvicorn: pip install 'kvforge[serve]'") from err


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default: Any, kind: type, low: float | None = None, high: float | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{name}' must be between {low} and {high}, got {value!r}", param=name)
    return kind(value)


def create_app(export_dir: str | Path, *, max_batch: int = 8, max_seq_len: int | None = None,
               api_key: str | None = None, model_name: str | None = None, prefill_chunk: int = 128,
               max_queue: int = 64, threads: int | None = None):
    """The FastAPI app serving one export (also what the Ray Serve deployment wraps)."""
    _require()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.request import FinishReason, openai_finish_reason
    from kvforge.runtime.scheduler import Delta, Done, Scheduler

    options = {"threads": threads} if threads is not None else {}
    generator = Generator(export_dir, **options)
    scheduler = Scheduler(generator, max_batch=max_batch, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                          max_queue=max_queue).start()
    name = model_name or Path(export_dir).resolve().name
    created = int(time.time())
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        scheduler.close()

    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.generator = generator

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                               kind="authentication_error", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    async def _json(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {name!r}", param="model",
                           code="model_not_found")
        return body

    def _generation_request(body: dict, prompt_ids: list[int]) -> GenerationRequest:
        """The one request type, from OpenAI's parameters (Generator.request resolves the sampling)."""
        max_tokens = _number(body, "max_tokens", None, int, 1, scheduler.capacity)
        if max_tokens is None:
            max_tokens = _number(body, "max_completion_tokens", 16, int, 1, scheduler.capacity)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
        temperature = _number(body, "temperature", None, float, 0.0, 2.0)
        top_p = _number(body, "top_p", None, float, 0.0, 1.0)
        seed = _number(body, "seed", None, int, 0, 2**63 - 1)
        if _number(body, "n", 1, int) != 1:
            raise ApiError(400, f"only n=1 is supported (one choice per request), got {body.get('n')!r}", param="n")
        # OpenAI's temperature 0 is greedy decoding (top_p and seed then do nothing).
        sampling: dict[str, Any] = ({"greedy": True} if temperature == 0.0 else
                                    {"temperature": temperature, "top_p": top_p, "seed": seed})
        try:
            return generator.request(prompt_ids, max_tokens, stop=stop, **sampling)
        except InputError as err:
            raise ApiError(400, str(err)) from err

    async def _run(request: Request, generation: GenerationRequest, stream: bool, kind: str, rid: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            handle = scheduler.submit(generation, on_event=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        except QueueFullError as err:
            raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from err
        except CapacityError as err:
            raise ApiError(413, str(err), param="max_tokens", code="context_length_exceeded") from err
        except InputError as err:
            raise ApiError(400, str(err)) from err
        except KvforgeError as err:
            raise ApiError(503, str(err), kind="server_error") from err

        def chunk(text: str, reason: str | None) -> dict[str, Any]:
            if kind == "chat":
                delta = {"content": text} if text else {}
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": name,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}

        def usage(done: Done) -> dict[str, Any]:
            return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                    "total_tokens": done.prompt_tokens + done.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

        if stream:
            async def sse():
                if kind == "chat":
                    first = chunk("", None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield f"data: {json.dumps(first)}\n\n"
                try:
                    while True:
                        event = await events.get()
                        if isinstance(event, Delta):  # one chunk per token, text "" while held back
                            yield f"data: {json.dumps(chunk(event.text, None))}\n\n"
                            continue
                        if event.finish_reason == FinishReason.ERROR:
                            yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                        else:
                            last = chunk("", openai_finish_reason(event.finish_reason))
                            last["usage"] = usage(event)
                            yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                finally:
                    handle.cancel()  # the client went away (or we are done: then a no-op)

            return StreamingResponse(sse(), media_type="text/event-stream")

        parts: list[str] = []
        try:
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    parts.append(event.text)
                    continue
                break
        finally:
            handle.cancel()
        if event.finish_reason == FinishReason.ERROR:
            raise ApiError(500, event.error or "generation failed", kind="server_error")
        text = "".join(parts)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": openai_finish_reason(event.finish_reason)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": openai_finish_reason(event.finish_reason), "logprobs": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice],
                "usage": usage(event)}

    def _stream_flag(body: dict) -> bool:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
        return stream

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if generator.tokenizer is None:
                raise ApiError(400, "this export has no tokenizer: send 'prompt' as a list of token ids", param="prompt")
            ids = generator.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt)", param="prompt")
        generation = _generation_request(body, ids)
        return await _run(request, generation, _stream_flag(body), "text", f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        try:
            ids = generator.chat_ids(messages)
        except InputError as err:
            raise ApiError(400, str(err), param="messages") from err
        generation = _generation_request(body, ids)
        return await _run(request, generation, _stream_flag(body), "chat", f"chatcmpl-{uuid.uuid4().hex}")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvforge"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def metrics():
        s = scheduler.snapshot()
        decode_tps = s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] else 0.0
        ttft = s["ttft_ms_sum"] / s["ttft_count"] / 1e3 if s["ttft_count"] else 0.0
        lines = [
            ("kvforge_queue_length", "gauge", "requests waiting or being prefilled", s["waiting"]),
            ("kvforge_running_requests", "gauge", "rows of the running batch in use", s["running"]),
            ("kvforge_requests_total", "counter", "requests accepted", s["requests"]),
            ("kvforge_requests_rejected_total", "counter", "requests refused with 429", s["rejected"]),
            ("kvforge_completion_tokens_total", "counter", "tokens generated", s["completion_tokens"]),
            ("kvforge_prefill_tokens_total", "counter", "prompt tokens run through the graph", s["prefilled_tokens"]),
            ("kvforge_cached_prompt_tokens_total", "counter", "prompt tokens reused from earlier turns", s["cached_tokens"]),
            ("kvforge_decode_tokens_per_second", "gauge", "tokens per second of decode steps (all rows together)",
             decode_tps),
            ("kvforge_time_to_first_token_seconds_mean", "gauge", "mean time to first token", ttft),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def serve(export_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          ready: Callable[[], None] | None = None, **options: Any) -> None:
    """Run the app with uvicorn until interrupted; `ready()` is called once the app is built."""
    _require()
    import uvicorn

    app = create_app(export_dir, **options)
    if ready is not None:
        ready()
    uvicorn.run(app, host=host, port=port, log_level="warning")
