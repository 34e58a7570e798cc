"""What a native library (TensorRT's builder) writes straight to file descriptor 2, past Python's sys.stderr:
captured for a block so that a failed build can show it, in order with Python's own output."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


class Captured:
    text = ""


def write_stderr(text: str) -> None:
    if sys.stderr is not None:
        sys.stderr.write(text)
        sys.stderr.flush()


def flush_stderr() -> None:
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except (OSError, ValueError):  # closed or detached: nothing buffered to keep in order
        pass


@contextmanager
def fd2_captured() -> Iterator[Captured]:
    """File descriptor 2 redirected into a temporary file for the block (a native library writes there
    directly, past Python's sys.stderr); `.text` holds what was written, once the block ends. Without a
    temporary file or an open fd 2, nothing is captured (the build goes on all the same)."""
    captured = Captured()
    try:
        sink = tempfile.TemporaryFile()
    except OSError:
        yield captured
        return
    with sink:
        try:
            saved = os.dup(2)
        except OSError:
            yield captured
            return
        flush_stderr()
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")
