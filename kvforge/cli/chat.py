"""`kvforge chat EXPORT_DIR`: an interactive terminal chat (registered on the group in kvforge/cli/__init__.py).

Each turn re-renders the whole conversation with the export's chat template and submits it to a
one-row continuous-batching Scheduler (runtime/drivers/scheduler.py), the server's engine: its PrefixStore
keeps the KV rows of the finished (or interrupted) turn, so the next turn prefills only what the
conversation added.

Keys: `/reset` forgets the conversation (and its cached KV rows), `/exit` or Ctrl-D quits. Ctrl-C
while an answer streams stops that answer, which stays in the conversation as far as it got (its
question is dropped too when nothing was generated yet); Ctrl-C at the prompt clears the line.
Piped stdin is read line by line, one turn per line (a line that is not UTF-8 is reported and
skipped), and Ctrl-C stops the program (exit 130).
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvforge.cli.common import (
    BACKEND_CHOICES,
    backend_options,
    chat_template_option,
    check_utf8,
    emulation_option,
    no_spin_option,
    sampling_keywords,
    sampling_options,
)
from kvforge.cli.speculation import check_flags, speculation_options
from kvforge.core.errors import InputError, KvforgeError
from kvforge.tools import speculation
from kvforge.tools.speculation import summary

if TYPE_CHECKING:  # the runtime is imported when the command runs (startup time)
    from kvforge.runtime import LoadedExport
    from kvforge.runtime.drivers.scheduler import Done, Scheduler

PROMPT = "> "
COMMANDS = "/reset forgets the conversation, /image PATH adds an image to your next message (a vision-language " \
           "export), /exit or Ctrl-D quits, Ctrl-C stops an answer"


@dataclass
class Turn:
    """One answer: its text as streamed, how the scheduler ended it, and how long it took."""

    text: str
    done: Done
    seconds: float
    interrupted: bool = False
    context_full: bool = False  # its length limit was the room left in --max-seq-len, not --max-new-tokens
    speculation: dict[str, Any] | None = None  # with --speculate: kvforge/tools/speculation.py's report of the turn

    def stats(self) -> dict[str, Any]:
        done = self.done
        ttft = done.ttft_ms / 1e3 if done.ttft_ms is not None else self.seconds
        decode_s = self.seconds - ttft
        # Decode speed as `kvforge generate` reports it: the tokens after the first over the time after it.
        rate = (done.completion_tokens - 1) / decode_s if done.completion_tokens > 1 and decode_s > 0 else 0.0
        return {"answer": self.text, "finish_reason": str(done.finish_reason), "prompt_tokens": done.prompt_tokens,
                "cached_tokens": done.cached_tokens, "completion_tokens": done.completion_tokens,
                "ttft_ms": round(ttft * 1e3, 3), "decode_tokens_per_s": round(rate, 2),
                **({"speculation": self.speculation} if self.speculation is not None else {})}


class ChatSession:
    """A conversation with `export` through `scheduler` (one row): `ask` answers a user message
    and keeps both in `messages`; `reset` starts over."""

    def __init__(self, export: LoadedExport, scheduler: Scheduler, system: str | None, max_new_tokens: int,
                 special_tokens_in_content: bool = False, **request_options: Any) -> None:
        self.export = export
        self.special_tokens_in_content = special_tokens_in_content  # LoadedExport.chat_ids' option
        self.scheduler = scheduler
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.request_options = request_options  # export.request()'s sampling keywords and ignore_eos
        self.messages: list[dict[str, Any]] = []
        self.images: list[Any] = []  # /image: read and checked, for the next user message
        self.reset()
        # A template that refuses the system role (or any message) says so now, not at the first turn.
        export.chat_ids([*self.messages, {"role": "user", "content": "Hi"}])

    def reset(self) -> None:
        """Forget the conversation and the KV rows kept of it: the next turn prefills from scratch."""
        from kvforge.runtime.drivers.scheduler import PrefixStore

        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.images = []
        # Between turns the scheduler thread does not touch its prefix store (a turn's rows are stored
        # before its Done is sent), so swapping it here is safe.
        self.scheduler.prefixes = PrefixStore(self.scheduler.prefixes.budget_bytes)

    def add_image(self, path: str) -> None:
        """/image PATH: an image for the next message, read, checked and encoded now (InputError for a bad one);
        the conversation keeps its features, not its pixels."""
        from kvforge.runtime.drivers.loaded_export import NO_IMAGES

        if self.export.images is None:
            raise InputError(NO_IMAGES.format(folder=self.export.folder))
        self.images.append(self.export.images.encode([path.strip()])[0])

    def ask(self, text: str, emit: Callable[[str], None], stop: Callable[[], bool] = lambda: False) -> Turn:
        """Answer `text`, passing the answer's text to `emit` as it is generated. Once `stop()` is
        true the answer is cancelled (Turn.interrupted) and nothing more is emitted. Errors raise
        KvforgeError and leave the conversation as it was."""
        from kvforge.runtime.controls.request import FinishReason
        from kvforge.runtime.drivers.scheduler import Done

        question: dict[str, Any] = {"role": "user", "content": text}
        if self.images:  # the conversation keeps its images: a later turn's prefix (and cache) holds them too
            question["content"] = [{"type": "text", "text": text},
                                   *({"type": "image", "image": image} for image in self.images)]
        events: queue.Queue = queue.Queue()
        counts = self._speculation_counts()  # the scheduler runs this turn alone: its counters' growth is the turn's
        try:
            request = self._request(question)
            started = time.perf_counter()
            handle = self.scheduler.submit(request, on_event=events.put)
        except KvforgeError as err:
            if not self.images:
                raise
            # A refused message drops its pending images: otherwise every later message would be refused too.
            count, self.images = len(self.images), []
            raise type(err)(f"{err} (the {count} image(s) added with /image were dropped)") from err
        pieces: list[str] = []
        while True:
            if stop() and not handle.cancelled.is_set():
                handle.cancel()  # the scheduler ends it at its next step, with a Done
            try:
                event = events.get(timeout=0.05)  # short waits: `stop` is polled
            except queue.Empty:
                continue
            if isinstance(event, Done):
                break
            if event.text and not handle.cancelled.is_set():
                pieces.append(event.text)
                emit(event.text)
        seconds = time.perf_counter() - started
        if event.finish_reason == FinishReason.ERROR:
            raise KvforgeError(f"the answer failed: {event.error}")
        answer = "".join(pieces)
        interrupted = handle.cancelled.is_set()
        if answer or not interrupted:
            self.messages += [question, {"role": "assistant", "content": answer}]
            self.images = []
        return Turn(answer, event, seconds, interrupted, context_full=request.max_new_tokens < self.max_new_tokens,
                    speculation=self._speculation_report(counts))

    def _speculation_counts(self) -> dict[str, Any] | None:
        """The scheduler's speculation counters now (None: it does not speculate)."""
        from kvforge.tools.speculation import scheduler_counts

        default = getattr(getattr(self.scheduler, "speculation", None), "default", None)
        return scheduler_counts(self.scheduler.snapshot()) if default is not None and not default.off else None

    def _speculation_report(self, before: dict[str, Any] | None) -> dict[str, Any] | None:
        from kvforge.tools.speculation import report_between

        after = self._speculation_counts()
        if before is None or after is None:
            return None
        default = self.scheduler.speculation.default
        return report_between(default.method, default.draft_len, before, after)

    def _request(self, question: dict[str, Any]) -> Any:
        """The scheduler's request for the conversation and `question` (InputError when it no longer fits)."""
        from kvforge.runtime.text.prompts import RenderedChat

        ids, images = self.export.chat_inputs([*self.messages, question],
                                              special_tokens_in_content=self.special_tokens_in_content)
        expanded = self.export.images.prompt_length(ids, images) if images else len(ids)
        room = self.scheduler.capacity - expanded + 1  # the last generated token is never fed back
        if room < 1:
            raise InputError(f"the conversation ({len(ids)} tokens) no longer fits in the {self.scheduler.capacity} "
                             "positions of --max-seq-len; /reset starts over")
        return self.export.request(RenderedChat(ids), min(self.max_new_tokens, room), images=images or None,
                                   **self.request_options)


def _stat_line(turn: Turn) -> str:
    s = turn.stats()
    line = (f"[{s['completion_tokens']} tokens, {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached, "
            f"ttft {s['ttft_ms']:.0f} ms, {s['decode_tokens_per_s']:.1f} tokens/s")
    if turn.speculation is not None:
        line += ", " + summary(turn.speculation)
    if turn.interrupted:
        line += ", interrupted"
    elif s["finish_reason"] == "length":
        line += ", cut at the end of --max-seq-len (/reset)" if turn.context_full else ", cut at --max-new-tokens"
    return line + "]"


@click.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--system", "system_text", help="A system message that starts the conversation (kept by /reset).")
@click.option("--max-new-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="Most tokens per answer (fewer when the conversation nears --max-seq-len).")
@sampling_options
@click.option("--ignore-eos", is_flag=True, help="Run each answer to --max-new-tokens even past end-of-turn tokens.")
@click.option("--max-seq-len", type=click.IntRange(2), default=None,
              help="Positions of the whole conversation (default: the export's max_capacity, at most 4096).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="ort-cpu (default for ort/onnx exports), emulate (default for trt exports), ort-cuda or "
                   "tensorrt: any backend with row operations.")
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime backends: intra-op threads.")
@emulation_option
@no_spin_option
@click.option("--verify", is_flag=True, help="Re-hash every file (weights too) against the manifest before loading.")
@click.option("--quiet", is_flag=True, help="No banner and no statistics line after each answer.")
@chat_template_option
@click.option("--special-tokens-in-content", is_flag=True,
              help="Let special-token text typed in a message (e.g. '<|im_end|>') become control tokens, as "
                   "transformers' templates do; by default it stays text.")
@speculation_options()
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per answer on stdout (answer, finish_reason, token counts, ttft_ms, "
                   "decode_tokens_per_s; with --speculate, the drafts and what was accepted) instead of streamed "
                   "text.")
def chat(export_dir: Path, system_text: str | None, max_new_tokens: int, ignore_eos: bool,
         max_seq_len: int | None, backend: str | None, threads: int | None, emulation: str | None, no_spin: bool,
         verify: bool, quiet: bool, chat_template: str | None, special_tokens_in_content: bool, as_json: bool,
         speculate: str | None, draft: Path | None, draft_len: int, **sampling: Any) -> None:
    """Chat with an export in the terminal (multi-turn; earlier turns' KV rows are reused).

    /reset forgets the conversation, /exit or Ctrl-D quits; Ctrl-C stops the answer being written
    (what was written stays in the conversation) and clears the line at the prompt. With piped
    input each line is a turn."""
    from kvforge.runtime import LoadedExport

    check_utf8("--system", system_text)
    check_flags(speculate, draft, draft_len)
    loading = backend_options(threads=threads, emulation=emulation, spinning=False if no_spin else None)
    export = LoadedExport(export_dir, backend=backend, verify_hashes=verify,
                          **speculation.target_options(export_dir, backend, speculate, loading))
    if chat_template is not None:  # as `kvforge serve --chat-template`: instead of the export's
        from kvforge.runtime.text.chat import chat_template_override

        export.use_chat_template(chat_template_override(chat_template, export.folder, export.manifest))
    try:
        export.chat_template  # noqa: B018  (raises when the export has none)
    except InputError as err:
        raise InputError(f"{err} (kvforge chat renders every turn with the export's chat template: give one with "
                         f"--chat-template FILE, or `kvforge generate {export_dir} --prompt TEXT` takes plain "
                         "prompts)") from None
    speculation.check_target(export, speculate)
    draft_export = (speculation.open_draft(draft, export, **backend_options(threads=threads))
                    if draft is not None else None)
    scheduler = chat_scheduler(export, max_seq_len, speculate=speculate, draft_len=draft_len,
                               draft=draft_export).start()
    try:
        _loop(ChatSession(export, scheduler, system_text, max_new_tokens, ignore_eos=ignore_eos,
                          special_tokens_in_content=special_tokens_in_content, **sampling_keywords(sampling)),
              export, quiet, as_json)
    finally:
        scheduler.close()


def chat_scheduler(export: LoadedExport, max_seq_len: int | None, **speculation_options: Any) -> Scheduler:
    """The one-row Scheduler a chat runs on (not started). Unlike the server's, it keeps the KV rows
    of a cancelled (Ctrl-C) answer, as of a finished one: that answer stays in the conversation, so
    the next turn copies them instead of prefilling the whole conversation again. `speculation_options`: the
    Scheduler's speculate, draft_len and draft (every turn speculates with them)."""
    from kvforge.core.contract import KVLayout
    from kvforge.runtime.drivers.scheduler import Scheduler

    # The rows kept of a cancelled answer hold every token generated but the last, those generated after
    # Ctrl-C too (the chat drops their text): harmless, as the next turn's lookup copies only the
    # positions whose tokens its prompt shares, i.e. as far as the answer was shown.
    scheduler = Scheduler(export, max_batch=1, max_seq_len=max_seq_len, keep_cancelled=True, **speculation_options)
    # One conversation at a time: room for all of its KV rows is all the prefix store needs.
    scheduler.prefixes.budget_bytes = KVLayout.from_manifest(export.manifest).bytes(1, scheduler.capacity)
    return scheduler


def _loop(session: ChatSession, export: LoadedExport, quiet: bool, as_json: bool) -> None:
    interactive = sys.stdin.isatty()
    if interactive:
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8: an error for that line, not a crash
            sys.stdin.reconfigure(errors="surrogateescape")
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        if not quiet:
            click.echo(click.style(f"kvforge chat: {export.folder} on {export.backend_name}; {COMMANDS}",
                                   dim=True), err=True)

    def emit(piece: str) -> None:
        if not as_json:
            click.echo(piece, nl=False)
            sys.stdout.flush()

    number = 0  # piped input: the number of the line read, for its error
    while True:
        try:
            if interactive:
                line = input(PROMPT)
            else:
                number += 1
                line = _piped_line(sys.stdin.buffer.readline(), number)
                if line is None:
                    continue
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            if not interactive:
                raise
            click.echo()  # Ctrl-C at the prompt clears the line, as a shell does
            continue
        if not line:  # EOF (Ctrl-D)
            if interactive:
                click.echo()
            return
        text = line.rstrip("\r\n")
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            session.reset()
            if not quiet and not as_json:
                click.echo(click.style("[conversation cleared]", dim=True), err=True)
            continue
        if not command:
            continue
        if command.startswith("/image"):
            try:
                session.add_image(command.removeprefix("/image"))
            except KvforgeError as err:
                if not interactive:
                    raise
                click.echo(f"kvforge: error: {' '.join(str(err).split())}", err=True)
            continue
        try:
            check_utf8("the message", text)
            turn = _ask_until_ctrl_c(session, text, emit) if interactive else session.ask(text, emit)
        except KvforgeError as err:
            if not interactive:
                raise
            click.echo(f"kvforge: error: {' '.join(str(err).split())}", err=True)
            continue
        if as_json:
            click.echo(json.dumps(turn.stats()))
            continue
        click.echo()
        if not quiet:
            click.echo(click.style(_stat_line(turn), dim=True), err=True)


def _piped_line(raw: bytes, number: int) -> str | None:
    """Piped line `number` as text, or None when it is not UTF-8: that line is reported and skipped,
    as an interactive turn with a bad message is, and the lines after it are still answered."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        click.echo(f"kvforge: error: line {number} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at position "
                   f"{err.start}); skipped", err=True)
        return None


def _ask_until_ctrl_c(session: ChatSession, text: str, emit: Callable[[str], None]) -> Turn:
    """session.ask with Ctrl-C stopping the answer instead of the program. The handler only sets a
    flag (no KeyboardInterrupt between showing a piece of text and keeping it), which `ask` polls."""
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        return session.ask(text, emit, stop=lambda: bool(pressed))
    finally:
        signal.signal(signal.SIGINT, previous)
