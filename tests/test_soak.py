"""The serving soak (benchmarks/soak_server.py), reduced to run with the suite: the image and pre-quantised
exports of issue 53, each served by `kvforge serve` to 32 concurrent clients sending good requests (every
greedy answer equal to its solo answer), hostile ones (4xx JSON errors; hostile images for the vision-language
export), cancelled streams and clients that give up, while /health is probed (under 2 s) and the server's RSS
stays flat. The full run (64 clients, 2,000 requests per export) and its figures: benchmarks/README.md."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("psutil")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak_server  # noqa: E402

REDUCED = argparse.Namespace(requests=96, clients=32, warmup=8, seed=0, only_bad=None, export=None)


@pytest.mark.parametrize("kind", ["vlm", "gptq"])
def test_the_soak_on_image_and_prequantised_exports(kind, tmp_path, capsys, hf_folder) -> None:
    source = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "hf-chat")  # soak_server.chat_source's folder
    (source / "chat_template.jinja").write_text(soak_server.TEMPLATE)
    code = soak_server.soak_kind(kind, tmp_path, REDUCED)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"requests: {REDUCED.requests} in" in out and "PASS" in out
