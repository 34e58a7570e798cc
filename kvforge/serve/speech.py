"""`kvforge serve` of an encoder-decoder export (kvforge/core/encoder_contract.py).

A Whisper export answers OpenAI's POST /v1/audio/transcriptions and /v1/audio/translations (a multipart upload:
`file`, `model`, `language`, `response_format` json | text | verbose_json | srt | vtt, `temperature`,
`timestamp_granularities[]` segment: verbose_json, srt and vtt are decoded with Whisper's timestamps, their
segments timed by them); a text encoder-decoder (BART, Marian, ...) answers POST /v1/completions with the
source text as `prompt`. GET /v1/models and /health as for decoder-only exports; errors OpenAI-shaped.

Limits, each a 400 naming it: an empty file, an upload over `max_audio_bytes` (a body far beyond it is cut off by the
Guard with a 413 before it is read), audio longer than `max_audio_seconds`, a file that does not decode (a corrupt
or unsupported file: libsndfile's reason named). Requests run on worker threads (so /health keeps answering): each
encodes its own input, and their decoder rows are decoded together by one Seq2SeqBatcher
(runtime/drivers/seq2seq_batch.py), up to `max_batch` rows at once, rows joining and leaving between steps; beyond
`max_queue` waiting rows a request is a 429.
"""

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

from kvforge.core.errors import InputError, KvforgeError, QueueFullError
from kvforge.serve.guard import ApiError, Guard, answer_errors_as_json

AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
AUDIO_FIELDS = ("file", "model", "language", "response_format", "temperature", "timestamp_granularities[]")
DEFAULT_MAX_AUDIO_BYTES = 25 << 20  # OpenAI's own upload limit
DEFAULT_MAX_AUDIO_SECONDS = 30 * 60


def _stamp(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{separator}{millis % 1000:03d}"


def subtitles(segments: list[dict[str, Any]], kind: str) -> str:
    """The segments as SubRip (srt) or WebVTT (vtt) text."""
    separator = "," if kind == "srt" else "."
    cues = [f"{_stamp(s['start'], separator)} --> {_stamp(s['end'], separator)}\n{s['text']}\n" for s in segments]
    if kind == "srt":
        return "\n".join(f"{i + 1}\n{cue}" for i, cue in enumerate(cues))
    return "WEBVTT\n\n" + "\n".join(cues)


class SpeechHandlers:
    """The export's generator (and transcriber) behind a lock, and the answers in OpenAI's shapes."""

    def __init__(self, export_dir: str | Path, model_name: str, threads: int | None, max_audio_bytes: int,
                 max_audio_seconds: float, max_batch: int = 8, max_queue: int = 64, spinning: bool = True) -> None:
        from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
        from kvforge.runtime.drivers.seq2seq_batch import Seq2SeqBatcher
        from kvforge.runtime.drivers.transcribe import Transcriber

        self.generator = Seq2SeqGenerator(export_dir, threads=threads, spinning=spinning)
        self.batcher = Seq2SeqBatcher(self.generator, max_rows=max_batch, max_queue=max_queue)
        speech = self.generator.record.input == "features"
        self.transcriber = Transcriber(self.generator, self.batcher) if speech else None
        self.model_name, self.max_audio_bytes, self.max_audio_seconds = model_name, max_audio_bytes, max_audio_seconds
        self.created = int(time.time())

    # The serve loop's hooks (kvforge/serve/app.py serve): the batcher's thread stops at close.
    def close(self) -> None:
        self.batcher.close()

    def cut(self, _message: str) -> None:
        pass

    def transcribe(self, data: bytes, task: str, language: str | None, response_format: str,
                   temperature: float) -> tuple[Any, str]:
        """(the answer, its media type) for one upload; ApiError 400 for what is wrong with it."""
        from kvforge.runtime.controls.sampling import SamplingConfig
        from kvforge.runtime.media.audio import load_audio

        if self.transcriber is None:
            raise ApiError(404, f"{self.model_name} is a text model: it has no audio endpoints; POST /v1/completions",
                           code="no_audio")
        if not data:
            raise ApiError(400, "the uploaded file is empty", param="file", code="empty_file")
        if len(data) > self.max_audio_bytes:
            raise ApiError(400, f"the uploaded file is {len(data)} bytes, over this server's limit of "
                                f"{self.max_audio_bytes} bytes (kvforge serve --max-audio-bytes)", param="file",
                           code="file_too_large")
        try:
            samples, rate = load_audio(data)
        except InputError as err:
            raise ApiError(400, f"the uploaded file is not audio this server reads: {err}", param="file",
                           code="invalid_audio") from None
        duration = samples.size / rate
        if duration > self.max_audio_seconds:
            raise ApiError(400, f"the audio is {duration:.1f} s long, over this server's limit of "
                                f"{self.max_audio_seconds:g} s (kvforge serve --max-audio-seconds)", param="file",
                           code="audio_too_long")
        sampling = SamplingConfig() if temperature == 0 else SamplingConfig(greedy=False, temperature=temperature)
        timed = response_format in ("verbose_json", "srt", "vtt")  # segments: decoded with Whisper's timestamps
        found = self.transcriber.transcribe(samples, rate=rate, language=language, task=task, sampling=sampling,
                                            timestamps=timed)
        segments = [{"id": i, **segment} for i, segment in
                    enumerate(s for w in found.windows for s in w.get("segments", ()))]
        if response_format == "text":
            return found.text + "\n", "text/plain"
        if response_format in ("srt", "vtt"):
            return subtitles(segments, response_format), "text/plain" if response_format == "srt" else "text/vtt"
        if response_format == "verbose_json":
            return {"task": task, "language": found.language, "duration": round(duration, 3), "text": found.text,
                    "segments": segments}, "application/json"
        return {"text": found.text}, "application/json"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """/v1/completions of a text encoder-decoder: each prompt a source, each answer a choice."""
        if self.transcriber is not None:
            raise ApiError(404, f"{self.model_name} is a speech model: POST /v1/audio/transcriptions",
                           code="no_completions")
        prompts, max_tokens, sampling = completion_settings(body)
        tokenizer = self.generator.tokenizer()
        sources = [tokenizer.encode(text) for text in prompts]
        tokens = self.batcher.generate_ids(self.generator.encode_ids(sources), max_tokens, sampling=sampling)
        choices = [{"index": i, "text": self.generator.text(row), "logprobs": None,
                    "finish_reason": self.generator.finish_reason(row, max_tokens)}
                   for i, row in enumerate(tokens)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": sum(map(len, sources)), "completion_tokens": sum(map(len, tokens)),
                          "total_tokens": sum(map(len, sources)) + sum(map(len, tokens))}}


COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                     "min_p", "seed", "user")


def completion_settings(body: dict[str, Any]) -> tuple[list[str], int, Any]:
    """(the source texts, max_tokens, the SamplingConfig) of a text encoder-decoder's /v1/completions body: greedy
    unless `temperature` > 0 (then sampled, with top_p / top_k / min_p / seed). A parameter of the decoder-only
    endpoint this one does not implement (stream, n, stop, logprobs, echo, ...) is a 400 naming it, not ignored."""
    from kvforge.runtime.controls.sampling import SamplingConfig

    unknown = sorted(key for key, value in body.items() if key not in COMPLETION_FIELDS and value not in (None, False))
    if unknown:
        raise ApiError(400, f"{', '.join(unknown)}: not supported for an encoder-decoder export; it takes "
                            f"{', '.join(COMPLETION_FIELDS)}", param=unknown[0])
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ApiError(400, "prompt must be a non-empty string or a list of them (the source texts)", param="prompt")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 64))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
    temperature = body.get("temperature") or 0
    given = {key: body[key] for key in ("top_p", "top_k", "min_p", "seed") if body.get(key) is not None}
    try:
        sampling = SamplingConfig() if temperature == 0 else SamplingConfig(greedy=False, temperature=temperature,
                                                                            **given)
    except InputError as err:
        raise ApiError(400, str(err)) from None
    return prompts, max_tokens, sampling


def _check_audio_request(name: str, model: str | None, response_format: str, temperature: float,
                         granularities: list[str] | None) -> None:
    """An audio request's form fields, each wrong one an ApiError naming it."""
    if model is not None and model != name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {name!r}", param="model",
                       code="model_not_found")
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}",
                       param="response_format")
    if any(g != "segment" for g in granularities or ()):
        raise ApiError(400, "timestamp_granularities: only 'segment' is supported (word timestamps are not)",
                       param="timestamp_granularities[]")
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", param="temperature")


def create_seq2seq_app(export_dir: str | Path, *, api_key: str | None = None, model_name: str | None = None,
                       threads: int | None = None, allowed_hosts: Any = None,
                       max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
                       max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS, max_batch: int = 8,
                       max_queue: int = 64, spinning: bool = True) -> Any:
    """The FastAPI app of an encoder-decoder export (see the module docstring)."""
    from fastapi import FastAPI, File, Form, Request, UploadFile
    from fastapi.responses import JSONResponse, PlainTextResponse


    name = model_name or Path(export_dir).resolve().name
    handlers = SpeechHandlers(export_dir, name, threads, max_audio_bytes, max_audio_seconds, max_batch, max_queue,
                              spinning)
    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None)
    app.state.handlers = app.state.scheduler = handlers  # what serve() closes and cuts
    app.state.renderer = None
    # A body twice the file limit is cut off before it is read; up to that, the handler names the file's size.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=2 * max_audio_bytes + (1 << 16),
                       allowed_hosts=None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts),
                       form_paths=frozenset(AUDIO_PATHS))
    answer_errors_as_json(app)

    async def answer(task: str, file: UploadFile, model: str | None, language: str | None, response_format: str,
                     temperature: float, granularities: list[str] | None) -> Any:
        _check_audio_request(name, model, response_format, temperature, granularities)
        data = await file.read(max_audio_bytes + 1)
        try:
            out, media = await asyncio.get_running_loop().run_in_executor(
                None, handlers.transcribe, data, task, language, response_format, temperature)
        except QueueFullError as err:
            raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from None
        except KvforgeError as err:  # a language the model does not know, ...
            raise ApiError(400, str(err)) from None
        return JSONResponse(out) if media == "application/json" else PlainTextResponse(out, media_type=media)

    def audio_route(task: str) -> Any:
        async def route(request: Request, file: Annotated[UploadFile, File()],
                        model: Annotated[str | None, Form()] = None,
                        language: Annotated[str | None, Form()] = None, response_format: Annotated[str, Form()] = "json",
                        temperature: Annotated[float, Form()] = 0.0,
                        timestamp_granularities: Annotated[list[str] | None,
                                                           Form(alias="timestamp_granularities[]")] = None):
            unknown = sorted(set((await request.form()).keys()) - set(AUDIO_FIELDS))
            if unknown:  # OpenAI's `prompt` (previous text) among them: refused, not ignored
                raise ApiError(400, f"{', '.join(unknown)}: not supported by this server; it takes "
                                    f"{', '.join(AUDIO_FIELDS)}", param=unknown[0])
            return await answer(task, file, model, language, response_format, temperature, timestamp_granularities)

        return route

    for path, task in zip(AUDIO_PATHS, ("transcribe", "translate"), strict=True):
        app.post(path)(audio_route(task))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        with contextlib.suppress(KeyError):
            if body["model"] != name:
                raise ApiError(404, f"model {body['model']!r} is not served here; this server serves {name!r}",
                               param="model", code="model_not_found")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, handlers.complete, body)
        except QueueFullError as err:
            raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from None
        except KvforgeError as err:  # no tokenizer in the export, a source over the encoder's length, ...
            raise ApiError(400, str(err)) from None

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": handlers.created,
                                            "owned_by": "kvforge"}]}

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok", "model": name}

    return app

