"""kvforge/core/progress.py: every long step is shown with the time it covers."""

from __future__ import annotations

import io
import re
import time

from kvforge.core.progress import StepProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_output_stamps_each_step_with_the_time_since_the_command_began() -> None:
    out = io.StringIO()
    say = StepProgress(stream=out)
    say("converting the GGUF")
    time.sleep(0.2)
    say("tracing the model")
    say.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[kvforge] [")
    stamps = [float(re.match(r"\[kvforge\] \[\s*([\d.]+)s\] ", line).group(1)) for line in lines]
    assert stamps[0] < 0.2 <= stamps[1]
    assert lines[1].endswith("tracing the model")


def test_quiet_prints_nothing() -> None:
    out = io.StringIO()
    say = StepProgress(quiet=True, stream=out)
    say("x")
    say.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_live_display_with_each_steps_elapsed_time() -> None:
    out = _Terminal()
    say = StepProgress(stream=out)
    say("converting the GGUF")
    say("tracing the model")
    say.close()
    text = out.getvalue()
    assert "converting the GGUF" in text and "tracing the model" in text
    assert re.search(r"0:00:0\d", text)  # rich's elapsed-time column
    assert "done" in text  # finished steps stay on screen, marked done


def test_a_heartbeat_names_its_step_whole(monkeypatch) -> None:
    # "still prompt 'def main() (16 s)" cut inside a quote; "still round 1/3" lost the system's name (issue 43, 19).
    from kvforge.core import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    out = io.StringIO()
    say = StepProgress(stream=out)
    for message in ("prompt 2 of 3 (12 tokens, 'def main(): (x)'; about 40 s of prompts left)",
                    "timing ort-genai, round 1/3", "building the built-in recipe 'a (b)' in /x: a description"):
        say(message)
        time.sleep(0.35)
    say.close()
    still = [re.sub(r" \(\d+ s\)$", "", line.split("] ", 2)[2]) for line in out.getvalue().splitlines() if "still" in line]
    assert still == ["still prompt 2 of 3", "still timing ort-genai, round 1/3",
                     "still building the built-in recipe 'a (b)' in /x"], out.getvalue()


def test_a_message_wider_than_the_terminal_keeps_the_time_column() -> None:
    from rich.console import Console

    from kvforge.core.progress import live_display

    live = live_display(Console(file=io.StringIO(), width=40, force_terminal=True, color_system=None))
    live.add_task("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it", total=None)
    console = Console(file=io.StringIO(), width=40, color_system=None)
    console.print(live.make_tasks_table(live.tasks))
    [line] = console.file.getvalue().splitlines()
    assert re.search(r"0:00:00 tracing the model once", line) and len(line) <= 40, line


def test_bench_rounds_heartbeats_keep_the_systems_name(monkeypatch) -> None:
    # "still round 1/3" lost which system was being timed (issue 43, 19): the messages bench really says,
    # through the heartbeat, each system's worker taking a little over one heartbeat.
    import subprocess

    from kvforge.core import progress
    from kvforge.tools import bench

    def slow_worker(*_: object, **__: object) -> subprocess.CompletedProcess:
        time.sleep(0.3)
        return subprocess.CompletedProcess([], 0, stdout='{"ttft_ms": 1.0}\n', stderr="")

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(bench.subprocess, "run", slow_worker)
    monkeypatch.setattr(bench, "cold_start_ms", lambda *_: time.sleep(0.3) or 1.0)
    out = io.StringIO()
    say = StepProgress(stream=out)
    bench._rounds({"kvforge": "a", "ort-genai": "b"}, [], 1, 2, 6, "hello", say, None)
    say.close()
    still = [re.sub(r" \(\d+ s\)$", "", line.split("] ", 2)[2]) for line in out.getvalue().splitlines() if "still" in line]
    assert still == ["still timing kvforge, round 1/1", "still timing ort-genai, round 1/1",
                     "still timing the cold start of kvforge, round 1/1",
                     "still timing the cold start of ort-genai, round 1/1"], out.getvalue()


def test_a_narrow_terminal_keeps_the_time_column_of_a_long_step(monkeypatch) -> None:
    # A description wider than the terminal made rich drop the spinner and the time (issue 43, 22).
    monkeypatch.setenv("COLUMNS", "40")
    out = _Terminal()
    say = StepProgress(stream=out)
    say("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it, which takes a minute")
    say.close()
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).splitlines()[-1]
    assert re.fullmatch(r"done 0:00:0\d tracing the model once \(to…", last), repr(last)  # 40 columns, cut visibly


def test_a_labelled_step_keeps_its_label_and_its_step() -> None:
    # bench --backend ort-cuda said "still ort-cuda", TensorRT's builder "still TensorRT": the label named whose
    # step it was, and what ran was cut away with the rest (issue 43, 19).
    from kvforge.core.progress import _short

    assert _short("ort-cuda: batches 1, 8, 5 timed runs each after a warm-up") == \
        "ort-cuda: batches 1, 8, 5 timed runs each after a warm-up"
    assert _short("  TensorRT: Building engine (5 steps)") == "TensorRT: Building engine"
    assert _short("tracing the model once (torch.onnx, dynamo; every layer: why); the decode graph ...") == \
        "tracing the model once"  # a sentence before its colon is a step, not a label
    assert _short("'quoted': x") == "'quoted'"
