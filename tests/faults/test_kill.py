"""The fault and abuse suite, part 2: `kill -9` during an export and during a `--force` replacement.

A subprocess export is killed at a named point (the subprocess adds a fault hook that SIGKILLs it
there, then runs the CLI) or after a delay. Afterwards the output path must hold either the complete old export or the
complete new one (every file re-hashed, and it generates), never a mix or nothing; the next export
of the same output must clean up whatever the killed run left behind.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvforge.core.manifest import load_manifest
from kvforge.core.output_folder import StagedFolder, clean_stale

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

OLD_TARGET, NEW_TARGET = "onnx", "ort"  # the manifest's target tells the old export from the new


# `python -c KILL_AT POINT ARGS...`: the CLI with a fault hook that SIGKILLs the process at POINT.
KILL_AT = """
import os, signal, sys
from kvforge.core import output_folder
point = sys.argv.pop(1)
output_folder.FAULT_HOOKS.append(lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == point else None)
from kvforge.cli import main
main()
"""


def _export_cmd(model: Path, out: Path, fault: str | None = None) -> list[str]:
    head = [sys.executable, "-c", KILL_AT, fault] if fault else [sys.executable, "-m", "kvforge.cli"]
    return [*head, "export", str(model), "-o", str(out), "--force", "--target", NEW_TARGET]


def _run(model: Path, out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_export_cmd(model, out, fault), capture_output=True, text=True, timeout=600)


def _state(out: Path) -> str:
    """'old' or 'new' if `out` holds a complete export (every file re-hashed, it generates), 'absent'
    if nothing is there; anything else fails the test."""
    if not out.exists():
        return "absent"
    manifest = load_manifest(out, verify_hashes=True)
    from kvforge.runtime import Generator

    result = Generator(out).generate([[1, 5, 6]], max_new_tokens=3, greedy=True, ignore_eos=True)
    assert len(result.tokens[0]) == 3
    return {OLD_TARGET: "old", NEW_TARGET: "new"}[manifest["target"]]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module")
def old_export(exported) -> Path:
    return exported("llama-tiny", OLD_TARGET)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("export:model-loaded", "old"),
        ("export:graphs-built", "old"),
        ("export:weights-written", "old"),
        ("export:manifest-written", "old"),
        ("publish:before", "old"),
        ("publish:swapped", "new"),
        ("publish:deleting-old", "new"),
    ],
)
def test_kill_at_a_named_point_of_a_force_replacement(fault, expected, tmp_path, hf_folder, old_export) -> None:
    out = tmp_path / "export"
    shutil.copytree(old_export, out)
    killed = _run(hf_folder("llama-tiny"), out, fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _state(out) == expected
    assert _leftovers(out), "the kill should have left a staging folder behind (else the point was not reached)"
    # What the next export of the same output does first (shown end to end in the tests below).
    clean_stale(out)
    assert _leftovers(out) == [] and _state(out) == expected


def test_kill_of_a_first_export_leaves_no_folder_that_looks_valid(tmp_path, hf_folder) -> None:
    out = tmp_path / "export"
    killed = _run(hf_folder("llama-tiny"), out, "export:weights-written")
    assert killed.returncode == -signal.SIGKILL
    assert _state(out) == "absent"
    assert len(_leftovers(out)) == 1
    finished = _run(hf_folder("llama-tiny"), out)
    assert finished.returncode == 0, finished.stderr
    assert "left by an interrupted run" in finished.stderr
    assert _state(out) == "new" and _leftovers(out) == []


@pytest.mark.parametrize("delay", [3.0, 8.0, 13.0])
def test_kill_after_a_delay_leaves_old_or_new(delay, tmp_path, hf_folder, old_export) -> None:
    out = tmp_path / "export"
    shutil.copytree(old_export, out)
    process = subprocess.Popen(_export_cmd(hf_folder("llama-tiny"), out), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert _state(out) in ("old", "new")
    clean_stale(out)
    assert _state(out) in ("old", "new") and _leftovers(out) == []


def test_a_live_export_is_never_cleaned_by_another(tmp_path) -> None:
    # Another run's cleanup must skip a staging folder whose process still holds its lock.
    out = tmp_path / "export"
    with StagedFolder(out, "kvforge.json") as staged:
        assert staged.path is not None and staged.path.is_dir()
        assert clean_stale(out) == []
        assert staged.path.is_dir()
    assert _leftovers(out) == []


def test_without_an_atomic_swap_a_kill_between_the_renames_is_undone(tmp_path, monkeypatch) -> None:
    # Filesystems without renameat2(RENAME_EXCHANGE): the old folder is renamed aside, the new one in.
    # A kill between the two renames leaves no folder at the path; the next run puts the old one back.
    import kvforge.core.output_folder as output_folder

    out = tmp_path / "export"
    out.mkdir()
    (out / "kvforge.json").write_text(json.dumps({"format": "kvforge/1", "which": "old"}))
    monkeypatch.setattr(output_folder, "_exchange", lambda a, b: False)

    class Killed(BaseException):
        pass

    def die(name: str) -> None:
        if name == "publish:aside":
            raise Killed

    monkeypatch.setattr(output_folder, "fault_point", die)
    with pytest.raises(Killed), StagedFolder(out, "kvforge.json") as staged:
        assert staged.path is not None
        (staged.path / "kvforge.json").write_text(json.dumps({"format": "kvforge/1", "which": "new"}))
        staged.publish()
    assert not out.exists() and len(_leftovers(out)) == 1  # only the set-aside old folder
    clean_stale(out)
    assert json.loads((out / "kvforge.json").read_text())["which"] == "old" and _leftovers(out) == []
    # And without a kill, the fallback replaces the folder and leaves nothing behind.
    monkeypatch.setattr(output_folder, "fault_point", lambda name: None)
    with StagedFolder(out, "kvforge.json") as staged:
        assert staged.path is not None
        (staged.path / "kvforge.json").write_text(json.dumps({"format": "kvforge/1", "which": "new"}))
        staged.publish()
    assert json.loads((out / "kvforge.json").read_text())["which"] == "new" and _leftovers(out) == []


def test_legacy_partial_folders_are_cleaned(tmp_path) -> None:
    out = tmp_path / "export"
    stale = tmp_path / ".export.partial.abc123"
    stale.mkdir()
    (stale / "model.weights").write_bytes(b"\0" * 100)
    (tmp_path / ".other.partial.xyz").mkdir()  # another output's: not ours to touch
    assert clean_stale(out) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial.xyz"]
