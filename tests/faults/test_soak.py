"""The serving soak (benchmarks/soak_server.py), reduced to run with the suite: the image and pre-quantised
exports of issue 53, each served by `kvforge serve` to 32 concurrent clients sending good requests (every
greedy answer equal to its solo answer), hostile ones (4xx JSON errors; hostile images for the vision-language
export), cancelled streams and clients that give up, while /health is probed (under 2 s) and the server's RSS
stays flat; and a speculating server (issue 54: benchmarks/soak_speculation.py). The full runs (64 clients, 2,000
requests per export) and their figures: benchmarks/README.md, benchmarks/results/soak_speculation.json."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("psutil")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak_server  # noqa: E402
import soak_speculation  # noqa: E402

pytestmark = pytest.mark.slow  # soaks: long runs by nature

REDUCED = argparse.Namespace(requests=96, clients=32, warmup=8, seed=0, only_bad=None, export=None)


@pytest.mark.parametrize("kind", ["vlm", "gptq"])
def test_the_soak_on_image_and_prequantised_exports(kind, tmp_path, capsys, hf_folder) -> None:
    source = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "hf-chat")  # soak_server.chat_source's folder
    (source / "chat_template.jinja").write_text(soak_server.TEMPLATE)
    code = soak_server.soak_kind(kind, tmp_path, REDUCED)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"requests: {REDUCED.requests} in" in out and "PASS" in out


def test_the_soak_of_a_speculating_server(tmp_path, capsys, hf_folder) -> None:
    """llama-tiny fp32 served with its int4 export as the draft (benchmarks/soak_speculation.py), 64 clients: greedy
    answers (plain, opted out, the server's draft default, draft, prompt lookup) equal their solo answers, seeded
    sampled ones repeat (opted out, prompt lookup), and the request log shows each speculative request's drafts."""
    source = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "hf-chat")
    (source / "chat_template.jinja").write_text(soak_server.TEMPLATE)
    reduced = argparse.Namespace(requests=256, clients=64, warmup=10, seed=0, only_bad=None, export=None)
    code = soak_speculation.soak_speculation(tmp_path, reduced)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "requests: 256 in" in out and "PASS" in out
    assert "methods ['draft', 'prompt-lookup']" in out and "none with drafts: True" in out
    for way in ("greedy default", "greedy off", "greedy draft", "greedy prompt-lookup", "sampled off",
                "sampled prompt-lookup"):
        assert f"good {way} " in out or f"good streamed {way} " in out, way
