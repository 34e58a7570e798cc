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
