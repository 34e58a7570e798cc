"""The CLI's progress display for long work (GGUF conversion, trace, optimise, write, quantise, build).

The exporter, builder and benchmark report progress as plain messages through a `say(message)` callback;
each message starts a step. On a terminal, rich shows the running step with a spinner and its elapsed
time, and keeps each finished step on screen with the time it took. Elsewhere (CI logs, pipes) each
message is one line stamped with the time since the command began, so every printed time says what
it covers; a step that runs long (tracing: about a minute) adds a "still ..." line every HEARTBEAT_S
seconds, so a log never looks stuck.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any, TextIO

HEARTBEAT_S = 15.0  # plain output: a "still <step> (N s)" line this often while one step runs


class StepProgress:
    """`say(message)`: a new step; `close()`: finish the last one (call before printing results)."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.began = time.perf_counter()
        self._live: Any = None
        self._task: Any = None
        if not quiet and self.stream.isatty():
            from rich.console import Console

            self._live = live_display(Console(file=self.stream))

        # Plain output's heartbeat: the running step's short name, when it began and when its next "still"
        # line is due, guarded by a lock shared with the thread that prints those lines.
        self._lock = threading.Lock()
        self._step: tuple[str, float, float] | None = None
        self._stop: threading.Event | None = None

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        if self._live is None:
            with self._lock:
                self._print(message)
                now = time.perf_counter()
                self._step = (_short(message), now, now + HEARTBEAT_S)
                if self._stop is None:
                    self._stop = threading.Event()
                    threading.Thread(target=self._heartbeat, args=(self._stop,), name="kvforge-progress",
                                     daemon=True).start()
            return
        if self._task is None:
            self._live.start()
        else:
            self._live.update(self._task, total=1, completed=1)
        self._task = self._live.add_task(message, total=None)

    def _print(self, message: str) -> None:
        elapsed = time.perf_counter() - self.began
        print(f"[kvforge] [{elapsed:6.1f}s] {message}", file=self.stream, flush=True)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S / 5):
            with self._lock:
                if self._step is None or stop.is_set():
                    continue
                name, began, due = self._step
                now = time.perf_counter()
                if now >= due:
                    # A step is said as it starts ("tracing ..."); a report of one that ended ("exported ...",
                    # "fused ...") is not what still runs.
                    finished = name.split(" ")[0].endswith("ed")
                    self._print(f"still working ({now - began:.0f} s after: {name})" if finished
                                else f"still {name} ({now - began:.0f} s)")
                    self._step = (name, began, due + HEARTBEAT_S)

    def close(self) -> None:
        """Stop the live display (its last step marked done), so results print below it; plain output's
        heartbeat stops too."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
            self._stop, self._step = None, None
        if self._live is not None and self._task is not None:
            self._live.update(self._task, total=1, completed=1)
            self._live.stop()
            self._task = None


def live_display(console: Any) -> Any:
    """rich's view: spinner, elapsed time, then the step's message cut to the terminal's width with an ellipsis
    (a message wider than the terminal made rich drop the spinner and the time). expand: rich applies a
    column's ratio, and so its ellipsis, only in a table as wide as the terminal; otherwise it crops mutely."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    return Progress(SpinnerColumn(finished_text="[green]done", table_column=Column(no_wrap=True, min_width=4)),
                    TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
                    TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                    console=console, expand=True)


def _short(message: str) -> str:
    """A step's name for its heartbeat: its message up to the first detail ('tracing the model once (torch.onnx,
    dynamo); ...' -> 'tracing the model once'), never cut inside a quoted text ("prompt 'def main():'"). A
    one-word label before a colon names whose step it is ('ort-cuda: batches 1, 8 ...', 'TensorRT: Building
    engine (5 steps)'), so it stays, with its step: cut at the colon, "still ort-cuda" says nothing of what runs."""
    text = message.strip()
    label, colon, rest = text.partition(": ")
    if colon and label and " " not in label and label[0] not in "'\"":
        return f"{label}: {_first_part(rest)}"
    return _first_part(text)


def _first_part(message: str) -> str:
    """`message` up to its first detail (a ';', a ':' or a ' (' outside quotes)."""
    i, quote = 0, None
    while i < len(message):
        char = message[i]
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"" and (i == 0 or message[i - 1] == " "):  # an opening quote, not an apostrophe
            quote = char
        elif char in ";:" or message.startswith(" (", i):
            break
        i += 1
    return message[:i].strip()


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR):
    """Raise another library's logger level for the duration only (its INFO lines would bury the progress), so an
    embedding application's logging setup is left as it was."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
