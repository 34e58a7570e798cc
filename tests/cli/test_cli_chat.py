"""`kvforge chat` driven through a pseudo-terminal, as a user types: two turns whose second reuses the
first's KV rows and answers as Generator.chat does, /reset, Ctrl-C mid-answer, Ctrl-C at the prompt,
/exit and Ctrl-D; an interrupted answer's KV rows reused by the next turn; piped lines with --json,
one that is not UTF-8 skipped; a template-less export refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from kvforge.runtime import Generator

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# The child makes the pty its controlling terminal, so that a typed \x03 is a SIGINT to it, and
# takes SIGINT back to its default: pytest started in the background (`pytest ... &` from a script)
# inherits it ignored, and Python then installs no KeyboardInterrupt handler.
CONTROLLING_TTY = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                   "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
STATS = rb"\x1b\[2m\[(\d+) tokens, (\d+) of (\d+) prompt tokens cached, [^\]]*\]\x1b\[0m\n"
INTERRUPTED = rb"\x1b\[2m\[(\d+) tokens, \d+ of \d+ prompt tokens cached, [^\]]*, interrupted\]\x1b\[0m\n> "


@pytest.fixture(scope="module")
def chat_export(exported, tmp_path_factory) -> Path:
    """The tiny llama export with a chat template added (and listed in its manifest, as an export
    of a model with one lists it): no second export."""
    out = tmp_path_factory.mktemp("chat") / "export"
    shutil.copytree(exported("llama-tiny"), out)
    template = out / "chat_template.jinja"
    template.write_text(TEMPLATE)
    manifest = json.loads((out / "kvforge.json").read_text())
    manifest["chat_template"] = template.name
    manifest["files"][template.name] = {"sha256": hashlib.sha256(template.read_bytes()).hexdigest(),
                                        "bytes": template.stat().st_size}
    (out / "kvforge.json").write_text(json.dumps(manifest, indent=2))
    return out


@pytest.fixture(scope="module")
def reference(chat_export) -> Generator:
    return Generator(chat_export)


class Terminal:
    """`kvforge ARGS` on a pseudo-terminal (stdin, stdout and stderr), its controlling terminal. Output
    post-processing is off, so the bytes read are the bytes written; NOFLSH keeps Ctrl-C from discarding
    output the test has not read yet (the answer shown before the interrupt)."""

    def __init__(self, *args: str) -> None:
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        attrs[3] |= termios.NOFLSH
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.proc = subprocess.Popen([sys.executable, "-c", CONTROLLING_TTY, "-m", "kvforge.cli", *args],
                                     stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     env={**os.environ, "TERM": "dumb"})
        os.close(slave)
        self.master = master
        self.output = b""
        self.seen = 0  # output before this was matched already

    def expect(self, pattern: bytes, timeout: float = 60) -> re.Match:
        """Wait until the output since the last match, as a whole, matches `pattern`."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.fullmatch(pattern, self.output[self.seen:], flags=re.S)
            if match:
                self.seen = len(self.output)
                return match
            left = deadline - time.monotonic()
            chunk = b""
            if left > 0 and select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 1 << 16)
                except OSError:  # EIO: the child is gone
                    pass
            assert chunk, f"waited for {pattern!r}; got {self.output[self.seen:]!r} (exit code {self.proc.poll()})"
            self.output += chunk

    def turn(self, line: str) -> tuple[str, int, int, int]:
        """Type `line`: (the answer as shown, its tokens, cached prompt tokens, prompt tokens)."""
        os.write(self.master, line.encode() + b"\n")
        match = self.expect(re.escape(line.encode()) + rb"\n(.*)\n" + STATS + b"> ")
        return (match.group(1).decode(), *map(int, match.group(2, 3, 4)))

    def ctrl_c_at_prompt(self, tries: int = 3) -> None:
        """Ctrl-C at the prompt: the line is dropped and a fresh prompt shown. CPython's readline
        checks for signals only when its select() is interrupted, so a SIGINT that lands while it is
        still echoing the last key waits for the next key (CI saw it once, under load): a user
        presses Ctrl-C again, and so does this, at most `tries` times."""
        for attempt in range(tries):
            os.write(self.master, b"\x03")
            try:
                self.expect(rb"\n> ", timeout=10)
                return
            except AssertionError:
                if attempt == tries - 1 or self.output[self.seen:]:  # output that is not the prompt: a failure
                    raise

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.master)


def test_two_turns_reset_ctrl_d(chat_export, reference) -> None:
    term = Terminal("chat", str(chat_export), "--max-new-tokens", "8", "--greedy")
    try:
        term.expect(rb"\x1b\[2mkvforge chat: .*Ctrl-C stops an answer\x1b\[0m\n> ")
        messages = [{"role": "user", "content": "Tell me a story"}]
        answer, tokens, cached, prompt = term.turn("Tell me a story")
        want = reference.chat(messages, max_new_tokens=8, greedy=True)
        assert (answer, tokens, cached, prompt) == (want.text[0], len(want.tokens[0]), 0, want.prompt_tokens[0])

        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        answer, tokens, cached, prompt = term.turn("and then?")
        want = reference.chat(messages, max_new_tokens=8, greedy=True)
        assert (answer, tokens, prompt) == (want.text[0], len(want.tokens[0]), want.prompt_tokens[0])
        # The first turn's prompt at least (its answer too where the text re-tokenizes to the same ids).
        first_prompt = len(reference.chat_ids(messages[:1]))
        assert first_prompt - 1 <= cached < prompt

        os.write(term.master, b"/reset\n")
        term.expect(rb"/reset\n\x1b\[2m\[conversation cleared\]\x1b\[0m\n> ")
        answer, tokens, cached, prompt = term.turn("Tell me a story")  # the same question, nothing kept
        assert (answer, cached, prompt) == (reference.chat(messages[:1], max_new_tokens=8, greedy=True).text[0], 0,
                                            first_prompt)

        os.write(term.master, b"half a line")
        term.expect(rb"half a line")
        term.ctrl_c_at_prompt()  # drops the line, not the program
        os.write(term.master, b"\x04")  # Ctrl-D on an empty line
        term.expect(rb"\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_ctrl_c_stops_the_answer_and_keeps_what_was_shown(chat_export, reference) -> None:
    # An answer that runs to the end of the context (2048 positions, ~1 s or more): time to interrupt it.
    term = Terminal("chat", str(chat_export), "--max-new-tokens", "5000", "--ignore-eos", "--greedy",
                    "--max-seq-len", "2048", "--system", "Be brief.")
    try:
        term.expect(rb".*\n> ")
        os.write(term.master, b"Tell me a long story\n")
        begun = term.expect(rb"Tell me a long story\n(.+)").group(1)  # the answer has started
        os.write(term.master, b"\x03")
        match = term.expect(rb"(.*)\n" + INTERRUPTED)
        shown, tokens = begun + match.group(1), int(match.group(2))
        assert 0 < tokens < 2048 - 30
        # The terminal echoed ^C somewhere in the answer; what the program printed is the rest.
        partial = shown.replace(b"^C", b"", 1).decode()
        answer, _, cached, prompt = term.turn("Shorter, please")
        # The next turn's conversation holds the partial answer, exactly as shown.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a long story"},
                    {"role": "assistant", "content": partial}, {"role": "user", "content": "Shorter, please"}]
        assert prompt == len(reference.chat_ids(messages))
        # ... and reuses the interrupted turn's KV rows: its prompt at least (issue 34, item 15).
        assert len(reference.chat_ids(messages[:2])) - 1 <= cached < prompt
        assert answer  # the next turn answered
        os.write(term.master, b"/exit\n")
        term.expect(rb"/exit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_an_interrupted_answer_keeps_its_kv_rows(chat_export, reference) -> None:
    """Ctrl-C mid-answer (the flag `ask` polls): the next turn copies the KV rows of the interrupted
    turn's prompt and answer, as far as the re-rendered conversation shares their tokens, and answers
    as a fresh conversation with the same history does."""
    from kvforge.cli.chat import ChatSession, chat_scheduler

    scheduler = chat_scheduler(Generator(chat_export), 2048).start()
    try:
        # An answer that runs to the end of the context unless stopped: it is stopped after 6 pieces.
        session = ChatSession(scheduler.export, scheduler, "Be brief.", 1900, greedy=True, ignore_eos=True)
        shown: list[str] = []
        first = session.ask("Tell me a long story", shown.append, stop=lambda: len(shown) >= 6)
        assert first.interrupted and first.done.finish_reason == "cancelled" and len(shown) == 6
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a long story"},
                   {"role": "assistant", "content": "".join(shown)}]
        assert session.messages == history  # the answer as shown
        # Kept: the rows of the first prompt and of every token generated but the last (the scheduler
        # stops a step or more after the flag; lookups match tokens, so the extra rows are never
        # copied for text that was not shown).
        first_ids = reference.chat_ids(history[:2])
        generated = reference.chat(history[:2], max_new_tokens=first.done.completion_tokens, greedy=True,
                                   ignore_eos=True).tokens[0]
        kept = [*first_ids, *generated[:-1]]
        assert scheduler.prefixes.lookup([*kept, -1])[0] == len(kept)

        session.max_new_tokens = 8
        second = session.ask("Shorter, please", lambda piece: None)
        messages = [*history, {"role": "user", "content": "Shorter, please"}]
        want = reference.chat(messages, max_new_tokens=8, greedy=True, ignore_eos=True)
        assert (second.text, second.done.completion_tokens) == (want.text[0], len(want.tokens[0]))
        # Reused: as much of them as the next prompt starts with (the first prompt at least; the answer
        # too where its shown text re-tokenizes to the generated ids).
        ids = reference.chat_ids(messages)
        common = next((i for i, (a, b) in enumerate(zip(kept, ids, strict=False)) if a != b), min(len(kept), len(ids)))
        assert second.done.cached_tokens == min(common, len(ids) - 1)
        assert second.done.cached_tokens >= len(first_ids) - 1
    finally:
        scheduler.close()


def test_piped_lines_are_turns_and_json_reports_each(chat_export, reference) -> None:
    lines = "What is 2+2?\nAnd 3+3?\n/reset\nWhat is 2+2?\n"
    result = subprocess.run([sys.executable, "-m", "kvforge.cli", "chat", str(chat_export), "--max-new-tokens", "6",
                             "--greedy", "--json"], input=lines, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    turns = [json.loads(line) for line in result.stdout.splitlines()]
    first = reference.chat("What is 2+2?", max_new_tokens=6, greedy=True)
    assert [t["answer"] for t in turns] == [first.text[0], turns[1]["answer"], first.text[0]]
    assert [t["cached_tokens"] > 0 for t in turns] == [False, True, False]
    assert turns[0]["completion_tokens"] == len(first.tokens[0]) and turns[0]["finish_reason"] == "length"


def test_an_export_without_a_chat_template_is_refused(exported) -> None:
    result = subprocess.run([sys.executable, "-m", "kvforge.cli", "chat", str(exported("llama-tiny"))],
                            input="hi\n", capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "has no chat template" in result.stderr and "kvforge chat renders every turn with" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_piped_line_that_is_not_utf8_is_skipped(chat_export, reference) -> None:
    """Piped input goes on past a line that is not UTF-8 (one error on stderr naming it), as
    interactive input does (issue 34, item 16)."""
    lines = b"What is 2+2?\nAnd \xff3+3?\n/reset\nWhat is 2+2?\n"
    result = subprocess.run([sys.executable, "-m", "kvforge.cli", "chat", str(chat_export), "--max-new-tokens", "6",
                             "--greedy", "--json"], input=lines, capture_output=True, timeout=120)
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    first = reference.chat("What is 2+2?", max_new_tokens=6, greedy=True)
    assert [json.loads(line)["answer"] for line in result.stdout.splitlines()] == [first.text[0]] * 2
    assert stderr == "kvforge: error: line 2 is not valid UTF-8 (byte 0xff at position 4); skipped\n"
