"""The CLI's progress display for long work (GGUF conversion, trace, optimise, write, quantise, build).

The exporter, builder and benchmark report progress as plain messages through a `say(message)` callback;
each message starts a step. On a terminal, rich shows the running step with a spinner and its elapsed
time, and keeps each finished step on screen with the time it took. Elsewhere (CI logs, pipes) each
message is one line stamped with the time since the command began, so every printed time says what
it covers.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


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
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._live = Progress(SpinnerColumn(finished_text="[green]done"), TimeElapsedColumn(),
                                  TextColumn("{task.description}"), console=Console(file=self.stream))

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        if self._live is None:
            elapsed = time.perf_counter() - self.began
            print(f"[kvforge] [{elapsed:6.1f}s] {message}", file=self.stream, flush=True)
            return
        if self._task is None:
            self._live.start()
        else:
            self._live.update(self._task, total=1, completed=1)
        self._task = self._live.add_task(message, total=None)

    def close(self) -> None:
        """Stop the live display (its last step marked done), so results print below it."""
        if self._live is not None and self._task is not None:
            self._live.update(self._task, total=1, completed=1)
            self._live.stop()
            self._task = None
