"""Folders made once per test run and shared by the pytest-xdist workers (the conftests' session fixtures)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run sees (the parent of the workers' own temp
    folders), so a fixture's product is made by one worker and read by the others."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(exist_ok=True)
    return root


def made_once(root: Path, name: str, make: Callable[[Path], object]) -> Path:
    """root/name, made by `make(root/name)` in the first worker to ask; the others wait for it.
    Tests treat these folders as read-only (a test that edits one copies it first)."""
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-made folder of a worker that failed
            make(out)
            done.touch()
    return out


# The chat template the shared chat_export carries (tests/conftest.py), which tests render against.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# CI runs the tests not marked slow (README's test command); where a test repeats one check over every family, these
# representatives stay in that tier (plain attention with GQA, a softcapped and windowed one, q/k norms) and the others
# are marked slow: the full suite (`-m "slow or not slow"`) runs them all.
CI_FAMILIES = ("llama-tiny", "gemma2-tiny", "qwen3-tiny")


def every_family(recipes: list[str], keep: tuple[str, ...] = CI_FAMILIES) -> list[object]:
    """`recipes` as parameters, each one not in `keep` marked slow."""
    return [pytest.param(recipe, marks=() if recipe in keep else pytest.mark.slow) for recipe in recipes]
