"""OpenAI's generation parameters in, choices with log-probabilities out (kvforge/serve/app.py).

`sampling_options` turns a validated body's (kvforge/serve/protocol.py) sampling fields into
`Generator.request` keywords; `Choice` gathers one choice's text,
tokens and log-probabilities and writes them in the chat shape
(`logprobs.content = [{token, logprob, bytes, top_logprobs}]`) or the legacy completions shape
(`logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`), each token's text and bytes from
runtime/text/tokenizer.py's `TokenPieces`. With tools (runtime/controls/tool_calls.py), a chat choice's text goes through a
`DeltaStream` (content, and each tool call whole once it closes) and its message through `answer_message`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.runtime.controls.logprobs import TokenLogprob
from kvforge.runtime.controls.request import FinishReason, GenerationRequest, openai_finish_reason
from kvforge.runtime.controls.tool_calls import DeltaStream, ToolRequest, answer_message
from kvforge.runtime.drivers.scheduler import Delta, Done
from kvforge.runtime.text.tokenizer import TokenPieces

if TYPE_CHECKING:  # the validated body; pydantic is only needed by the server itself
    from kvforge.serve.protocol import OpenAIRequest


def sampling_options(body: OpenAIRequest, default_greedy: bool) -> dict[str, Any]:
    """`Generator.request` keywords for the (validated) body's temperature, top_p, top_k, min_p, seed,
    the penalties, n and logprobs. OpenAI's temperature 0 is greedy decoding: top_p, top_k, min_p and
    seed then do nothing, the penalties still apply (they change the argmax). Without a
    temperature, a filter asks to sample (as in the Python API), but one set to its "off" value
    (top_k 0 or -1, top_p 1, min_p 0) keeps the export's own choice (`default_greedy`)."""
    temperature = body.temperature
    filters = {"top_p": body.top_p,
               "top_k": None if body.top_k is None else max(body.top_k, 0),  # vLLM's -1 means off, as our 0
               "min_p": body.min_p, "seed": body.seed}
    options: dict[str, Any] = {
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "n": body.choices, "logprobs": body.alternatives(),
    }
    if temperature == 0.0:
        return {**options, "greedy": True}
    if temperature is None and all(filters[k] in (None, off) for k, off in (("top_k", 0), ("top_p", 1), ("min_p", 0))):
        options["greedy"] = default_greedy
    return {**options, **filters, "temperature": temperature}


class Choice:
    """One choice of a response: its text, token count, finish reason and log-probabilities (when
    asked for: `logprobs` alternatives per token). `prefix`: text before the generated text
    (completions' echo); `prompt_ids` / `prompt_logprobs`: the echoed prompt's tokens and their
    entries (None for the first token, which nothing predicts)."""

    def __init__(self, index: int, pieces: TokenPieces | None, logprobs: int | None, prefix: str = "",
                 prompt_ids: list[int] | None = None, prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        self.index = index
        self.pieces = pieces
        self.top = logprobs
        self.parts = [prefix]
        self.chars = len(prefix)
        self.finish_reason: str | None = None
        self.tokens: list[int] = []
        self.entries: list[TokenLogprob | None] = []
        self.offsets: list[int] = []
        if logprobs is not None and prompt_ids is not None:
            assert pieces is not None and prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids)
            self.tokens, self.entries = list(prompt_ids), list(prompt_logprobs)
            self.offsets = pieces.offsets(prompt_ids)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, text: str, logprobs: list[TokenLogprob] | None) -> tuple[int, int]:
        """Append a delta; returns the slice of the entries it added (what its streamed chunk carries)."""
        start = len(self.entries)
        if self.top is not None:
            for entry in logprobs or []:
                self.tokens.append(entry.token)
                self.entries.append(entry)
                self.offsets.append(self.chars)
        self.parts.append(text)
        self.chars += len(text)
        return start, len(self.entries)

    # -- OpenAI's shapes ------------------------------------------------------------------------------
    def chat_logprobs(self, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if self.top is None:
            return None
        return {"content": [self._chat_entry(e) for e in self.entries[start:end] if e is not None]}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        assert self.pieces is not None
        text, data = self.pieces(entry.token)
        top = []
        for token, logprob in entry.top:
            alt, alt_data = self.pieces(token)
            top.append({"token": alt, "logprob": logprob, "bytes": alt_data})
        return {"token": text, "logprob": entry.logprob, "bytes": data, "top_logprobs": top}

    def legacy_logprobs(self, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        """The completions shape. `top_logprobs` holds the chosen token too (so up to logprobs + 1
        entries, as OpenAI documents); the first prompt token has null for both."""
        if self.top is None:
            return None
        assert self.pieces is not None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry, offset in zip(self.tokens[start:end], self.entries[start:end], self.offsets[start:end],
                                        strict=True):
            out["tokens"].append(self.pieces(token)[0])
            out["text_offset"].append(offset)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.pieces(t)[0]: lp for t, lp in entry.top}
            top.setdefault(self.pieces(entry.token)[0], entry.logprob)
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(top)
        return out


@dataclass
class Job:
    """One prompt of a request: its ids, the request generating from it (None: completions'
    max_tokens 0, the prompt only scored), and for completions' echo its text and, with logprobs,
    its log-probabilities (Generator.prompt_logprobs)."""

    ids: list[int]
    request: GenerationRequest | None
    echo: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    positions: int | None = None  # the prompt's tokens as the model reads them (each image's tokens), if not len(ids)

    @property
    def prompt_tokens(self) -> int:
        """usage's prompt_tokens for this prompt: every image token counted, as OpenAI and vLLM count them."""
        return len(self.ids) if self.positions is None else self.positions


class Reply:
    """The response to one request: `n` choices per job (index = prompt x n + choice), filled from
    the scheduler's events (`add`, which also gives the streamed chunk), written in the chat or the
    completions shape (`body`, or the chunks of `opening` and `add`)."""

    def __init__(self, kind: str, rid: str, model: str, jobs: list[Job], pieces: TokenPieces, n: int,
                 logprobs: int | None, tools: ToolRequest | None = None) -> None:
        self.kind, self.rid, self.model, self.jobs, self.n, self.tools = kind, rid, model, jobs, n, tools
        self.choices = [Choice(p * n + i, pieces, logprobs, job.echo or "",
                               job.ids if job.echo is not None else None, job.prompt_logprobs)
                        for p, job in enumerate(jobs) for i in range(n)]
        # Per chat choice with tools: its streamed deltas (text held back while a call may be starting).
        self.deltas = {c.index: DeltaStream(tools) for c in self.choices} if tools is not None else {}
        self.dones: dict[int, Done] = {}
        self.pending = sum(n for job in jobs if job.request is not None)

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def opening(self) -> list[dict[str, Any]]:
        """The chunks streamed before any token: chat's role, completions' echoed prompt, and the
        end of every choice that generates nothing (max_tokens 0)."""
        chunks = []
        for c in self.choices:
            if self.kind == "chat":
                chunks.append(self._chunk(c, {"role": "assistant", "content": ""}, None, None))
            elif c.text:
                chunks.append(self._chunk(c, c.text, c.legacy_logprobs(), None))
        for p, job in enumerate(self.jobs):
            if job.request is None:
                for c in self.choices[p * self.n: (p + 1) * self.n]:
                    c.finish_reason = "length"
                    chunks.append(self._chunk(c, "", None, "length", last=self.finished and c is self.choices[-1]))
        return chunks

    def add(self, prompt: int, event: Delta | Done) -> list[dict[str, Any]]:
        """Take one event of prompt `prompt`'s request; the chunks that stream it."""
        c = self.choices[prompt * self.n + event.index]
        stream = self.deltas.get(c.index)
        if isinstance(event, Done):
            self.dones[c.index] = event
            self.pending -= 1
            chunks = [self._chunk(c, delta, None, None) for delta in stream.finish()] if stream is not None else []
            called = stream is not None and stream.calls > 0
            c.finish_reason = "tool_calls" if called else openai_finish_reason(event.finish_reason)
            return chunks + [self._chunk(c, "" if self.kind == "text" else {}, None, c.finish_reason,
                                         last=self.finished)]
        start, end = c.add(event.text, event.logprobs)
        if self.kind != "chat":
            return [self._chunk(c, event.text, c.legacy_logprobs(start, end), None)]
        logprobs = c.chat_logprobs(start, end)
        if stream is None:
            return [self._chunk(c, {"content": event.text} if event.text else {}, logprobs, None)]
        # The token's log-probabilities ride on the first delta it lets out (an empty one while held back).
        deltas = stream.feed(event.text) or [{}]
        return [self._chunk(c, delta, logprobs if i == 0 else None, None) for i, delta in enumerate(deltas)]

    def _chunk(self, c: Choice, content: Any, logprobs: dict | None, reason: str | None,
               last: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": c.index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
            out = {"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                   "choices": [choice]}
        else:
            choice = {"index": c.index, "text": content, "logprobs": logprobs, "finish_reason": reason}
            out = {"id": self.rid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                   "choices": [choice]}
        if last:
            out["usage"] = self.usage()
        return out

    def usage(self) -> dict[str, Any]:
        prompt = sum(job.prompt_tokens for job in self.jobs)
        completion = sum(d.completion_tokens for d in self.dones.values())
        # Every choice of a prompt shares its prefill: count its cached positions once.
        cached = sum(d.cached_tokens for i, d in self.dones.items() if i % self.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def called_tools(self) -> bool:
        """Whether an answer is a tool call (its finish_reason "tool_calls"; the request log says so too)."""
        return self.kind == "chat" and any(c.finish_reason == "tool_calls" or answer_message(c.text, self.tools)[1]
                                           for c in self.choices)

    def body(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = []
        for c in self.choices:
            if self.kind == "chat":
                message, called = answer_message(c.text, self.tools)
                choices.append({"index": c.index, "message": message, "logprobs": c.chat_logprobs(),
                                "finish_reason": "tool_calls" if called else c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": c.legacy_logprobs(),
                                "finish_reason": c.finish_reason or "length"})
        return {"id": self.rid, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices, "usage": self.usage()}


SPECULATION_COUNTS = ("draft_tokens", "accepted_tokens", "verify_steps")  # per choice, on a Done (the request log)


class Tally:
    """The scheduler's Done events of a request's choices (every prompt's n) merged into one Done,
    `done` once the last has come (at once when nothing is generated): the request's line in the log
    and its metrics. Tokens are summed (prefilled and cached positions once per prompt); the reason
    is an error's or a cancellation's if any, else the first choice's to end. Scheduler thread only."""

    def __init__(self, jobs: list[Job], n: int) -> None:
        self.pending = sum(n for job in jobs if job.request is not None)
        self.prompt_tokens = sum(job.prompt_tokens for job in jobs)
        self.dones: list[Done] = []
        self.done: Done | None = None if self.pending else self._merge()

    def add(self, done: Done) -> Done | None:
        """Take one choice's Done; the merged one when it was the last."""
        self.dones.append(done)
        self.pending -= 1
        if self.pending == 0:
            self.done = self._merge()
        return self.done

    def _merge(self) -> Done:
        worst = [d for d in self.dones if d.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED)]
        first = (worst or self.dones or [None])[0]
        ttfts = [d.ttft_ms for d in self.dones if d.ttft_ms is not None]
        per_prompt = [d for d in self.dones if d.index == 0]
        merged = Done(first.finish_reason if first is not None else FinishReason.LENGTH, self.prompt_tokens,
                      sum(d.completion_tokens for d in self.dones), sum(d.prefilled_tokens for d in per_prompt),
                      sum(d.cached_tokens for d in per_prompt), min(ttfts, default=None),
                      first.error if first is not None else None)
        for name in SPECULATION_COUNTS:  # summed over the choices, where the scheduler's Done reports them
            if self.dones and all(hasattr(d, name) for d in self.dones):
                setattr(merged, name, sum(getattr(d, name) or 0 for d in self.dones))
        return merged
