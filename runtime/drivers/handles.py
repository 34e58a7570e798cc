"""What a served request gives back: its events (Delta: new tokens and text; Done: how it ended) and the
RequestHandle a caller iterates, or whose events go to its callback (runtime/drivers/scheduler.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvforge.core.errors import InputError
from kvforge.runtime.controls.logprobs import TokenLogprob
from kvforge.runtime.controls.request import FinishReason, GenerationRequest


@dataclass
class Delta:
    """New output of one request: token ids and the stable text they add ("" while held back);
    with request.logprobs, one TokenLogprob per token; `index`: the choice (n > 1)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    index: int = 0


@dataclass
class Done:
    finish_reason: FinishReason  # EOS | STOP (stop token or string) | LENGTH | CANCELLED | ERROR
    prompt_tokens: int
    completion_tokens: int
    prefilled_tokens: int  # prompt positions actually run through the graph (once for all n choices)
    cached_tokens: int  # prompt positions copied from a previous turn
    ttft_ms: float | None
    error: str | None = None
    index: int = 0  # the choice (n > 1); each choice ends with its own Done
    client_error: bool = False  # ERROR caused by the request itself (its grammar failed), not the server
    # speculation (runtime/drivers/scheduler_speculation.py): this choice's drafted tokens, those the target kept,
    # and the verification calls that checked its drafts (0 for a row that did not speculate)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0


Event = Delta | Done


class RequestHandle:
    """What `Scheduler.submit` returns: iterate it (blocking) for Delta events ending with Done (with
    n > 1 choices, the events of all choices, ending after the n-th Done), or pass `on_event` to
    submit to receive them from the scheduler thread instead."""

    def __init__(self, request: GenerationRequest, request_id: int, on_event: Callable[[Event], None] | None) -> None:
        self.request = request
        self.id = request_id
        self._queue: queue.Queue[Event] | None = None if on_event is not None else queue.Queue()
        self._on_event = on_event if on_event is not None else self._queue.put  # type: ignore[union-attr]
        self.cancelled = threading.Event()
        self.dones: dict[int, Done] = {}  # by choice index
        self.done: Done | None = None  # the last Done, once every choice has ended
        self._seen: list[Event] = []  # the events iterated so far (results() after a partial iteration)
        self._ended = 0  # Done events among them

    def cancel(self) -> None:
        """Stop generating for this request (the client went away); it ends with CANCELLED."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        if isinstance(event, Done):
            self.dones[event.index] = event
            if len(self.dones) == self.request.n:
                self.done = event
        self._on_event(event)

    def __iter__(self) -> Iterator[Event]:
        if self._queue is None:
            raise RuntimeError("this request delivers its events to on_event")
        while self._ended < self.request.n:
            event = self._queue.get()
            self._seen.append(event)
            self._ended += isinstance(event, Done)
            yield event

    def result(self) -> tuple[list[int], str, Done]:
        """Block until the request (n == 1) ends: (token ids, text, Done)."""
        if self.request.n != 1:
            raise InputError(f"this request has n={self.request.n} choices: use results()")
        return self.results()[0]

    def results(self) -> list[tuple[list[int], str, Done]]:
        """Block until every choice ends: (token ids, text, Done) per choice index."""
        for _ in self:
            pass
        tokens: list[list[int]] = [[] for _ in range(self.request.n)]
        text: list[list[str]] = [[] for _ in range(self.request.n)]
        for event in self._seen:
            if isinstance(event, Delta):
                tokens[event.index] += event.token_ids
                text[event.index].append(event.text)
        return [(tokens[i], "".join(text[i]), self.dones[i]) for i in range(self.request.n)]
