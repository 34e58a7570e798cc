"""The fault and abuse suite, part 4: no pickle and no remote code anywhere.

Unpickling a checkpoint can run arbitrary code, and so can `trust_remote_code`. kvforge reads
safetensors, JSON and ONNX only: the source says so, and an export still works with every pickle
entry point patched to fail.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("kvforge", "exporter", "runtime", "plugins", "models", "benchmarks")
FORBIDDEN = [
    (re.compile(r"\btorch\.load\("), "torch.load"),
    (re.compile(r"^\s*(import|from)\s+(pickle|_pickle|cPickle|dill|joblib|cloudpickle)\b"), "import pickle"),
    (re.compile(r"\b(pickle|dill|joblib)\.(load|loads|Unpickler)\b"), "pickle.load"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True"),
    (re.compile(r"weights_only\s*=\s*False"), "weights_only=False"),
]


def test_the_source_has_no_pickle_and_no_remote_code() -> None:
    hits = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for pattern, what in FORBIDDEN:
                    if pattern.search(line):
                        hits.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert hits == []


def test_the_scan_would_see_a_violation(tmp_path) -> None:
    line = "state = torch.load(path) or pickle.loads(blob)  # and trust_remote_code=True"
    assert [what for pattern, what in FORBIDDEN if pattern.search(line)] == [
        "torch.load", "pickle.load", "trust_remote_code=True"]
    assert [what for pattern, what in FORBIDDEN if pattern.search("import pickle")] == ["import pickle"]


def test_export_and_generate_never_unpickle(tmp_path, hf_folder, monkeypatch) -> None:
    pytest.importorskip("torch")
    import torch
    import torch.onnx  # noqa: F401  (import the exporter's stack before the patches)
    import transformers  # noqa: F401

    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    def refuse(*_args, **_kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    out = tmp_path / "export"
    export_model(hf_folder("qwen3-tiny"), out)
    assert Generator(out).generate([[1, 5, 6]], max_new_tokens=3, greedy=True).tokens[0]
