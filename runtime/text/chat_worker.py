"""Chat-template rendering in a child process, for the server.

A Jinja template is code from the model folder: `{% for i in range(100000) %}{% for j in
range(100000) %}{% endfor %}{% endfor %}` loops for hours in pure Python, and no thread can be
stopped from outside (nor does such a loop let signal handlers run promptly). So the server renders
in a long-lived child process with a memory limit, waits for the answer at most `seconds`, and kills
and replaces the child when it is late. The child only imports Jinja (and kvforge.runtime.text.chat):
it starts in a fraction of a second and costs one round trip per chat request.

Protocol (JSON lines on stdin/stdout): first the template {"template", "specials", "name",
"max_chars", "memory_bytes"}, answered by {"ready": true} once it is compiled, then per request
{"messages", "add_generation_prompt", "tools"} answered by {"text"} or {"error"}.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from kvforge.core.errors import InputError

RENDER_SECONDS = 2.0
STARTUP_SECONDS = 60.0
CHILD_MEMORY_BYTES = 1 << 30


class IsolatedRenderer:
    """Renders one ChatTemplate in a killable child process; thread-safe (one render at a time)."""

    def __init__(self, template: Any, seconds: float = RENDER_SECONDS, memory_bytes: int = CHILD_MEMORY_BYTES,
                 max_chars: int | None = None) -> None:
        from kvforge.runtime.text.chat import MAX_RENDERED_CHARS

        self.template = template  # a kvforge.runtime.text.chat.ChatTemplate
        self.seconds = seconds
        self._setup = {"template": template.text, "specials": template.specials, "name": template.source,
                       "max_chars": max_chars or MAX_RENDERED_CHARS, "memory_bytes": memory_bytes}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = bytearray()
        self._closed = False

    def start(self) -> IsolatedRenderer:
        with self._lock:
            try:
                self._ensure()
            except (OSError, EOFError) as err:
                self._kill()
                raise InputError(f"the chat template renderer (python -m kvforge.runtime.text.chat_worker) did not "
                                 f"start: {err or type(err).__name__}; is Jinja2 installed?") from err
        return self

    def _ensure(self) -> subprocess.Popen:
        if self._closed:
            raise InputError("the server is shutting down")
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            # -P: do not put the working folder first on the child's sys.path (3.11+).
            flags = ["-P"] if sys.version_info >= (3, 11) else []
            self._proc = subprocess.Popen(
                [sys.executable, *flags, "-m", "kvforge.runtime.text.chat_worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True)  # Ctrl-C in the terminal goes to the server, which stops the child
            self._buffer = bytearray()
            self._send(self._setup)
            # The child says when it has imported Jinja and compiled the template: a render's time
            # limit never includes a (slow, on a busy machine) start.
            if self._read_line(time.monotonic() + STARTUP_SECONDS) is None:
                self._kill()
                raise InputError(f"the chat template renderer did not start within {STARTUP_SECONDS:g} s")
        return self._proc

    def _send(self, obj: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self._proc.stdin.flush()

    def _read_line(self, deadline: float) -> bytes | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        end = self._buffer.index(b"\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        name = self._setup["name"]
        with self._lock:
            try:
                self._ensure()
                self._send({"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools})
                line = self._read_line(time.monotonic() + self.seconds)
            except (OSError, EOFError, ValueError):  # the child died (memory limit, killed)
                self._kill()
                raise InputError(f"{name} crashed the renderer on these messages (out of memory?); the template "
                                 "is broken: fix or replace it") from None
            if line is None:
                self._kill()  # a runaway template: the next request gets a fresh child
                raise InputError(f"{name} took more than {self.seconds:g} s to render these messages; the "
                                 "template is broken (or loops): fix or replace it")
        answer = json.loads(line)
        if "error" in answer:
            raise InputError(answer["error"])
        return answer["text"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kill()


def _child() -> None:
    """The child's loop: render each request, answer with the text or the error message."""
    import resource

    from kvforge.core.errors import KvforgeError
    from kvforge.runtime.text.chat import _compile, render

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    line = stdin.readline()
    if not line:
        return
    setup = json.loads(line)
    try:  # a template that builds huge strings gets a MemoryError here, not the machine's memory
        limit = int(setup["memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):
        pass
    try:
        _compile(setup["template"])  # cached for the renders; a syntax error is reported by each render
    except Exception:  # noqa: BLE001
        pass
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    for line in iter(stdin.readline, b""):
        request = json.loads(line)
        try:
            text = render(setup["template"], request["messages"], setup["specials"],
                          request["add_generation_prompt"], name=setup["name"], max_chars=setup["max_chars"],
                          tools=request.get("tools"))
            answer = {"text": text}
        except KvforgeError as err:
            answer = {"error": str(err)}
        except BaseException as err:  # noqa: BLE001 (MemoryError while answering, ...): still one answer
            answer = {"error": f"{setup['name']} failed on these messages: {type(err).__name__}"}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _child()
