"""What a new user reads (issue 17): why generation stopped, human file sizes, a --plot that fails before
measuring, the dequantised-GGUF hint, and the server's message for n > 1."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvforge.cli import dequantised_hint, human_bytes, main

pytest.importorskip("torch")


def test_generate_says_when_it_stopped_at_max_new_tokens(exported) -> None:
    folder = str(exported("llama-tiny"))
    result = CliRunner().invoke(main, ["generate", folder, "--prompt-ids", "1,50,60", "--max-new-tokens", "3",
                                       "--greedy", "--ignore-eos"])
    assert result.exit_code == 0 and "stopped at" not in result.stderr  # asked to run to the limit
    # A random model rarely ends early; 3 tokens end at the limit and the user is told so, on stderr.
    result = CliRunner().invoke(main, ["generate", folder, "--prompt-ids", "1,50,60", "--max-new-tokens", "3", "--greedy"])
    assert result.exit_code == 0
    assert "stopped at --max-new-tokens (3), not at an end-of-sequence token" in result.stderr
    assert "stopped at" not in result.stdout
    assert "3 tokens generated" in result.stderr


def test_inspect_shows_human_sizes(exported) -> None:
    result = CliRunner().invoke(main, ["inspect", str(exported("llama-tiny"))])
    assert result.exit_code == 0
    assert "0.00 MB" not in result.stdout and " KB" in result.stdout  # tokenizer_config.json and friends
    assert [human_bytes(n) for n in (0, 999, 1000, 269030016, 3 * 10**9)] == ["0 B", "999 B", "1.0 KB", "269.0 MB",
                                                                             "3.0 GB"]


def test_bench_plot_needs_are_checked_before_any_round(exported, monkeypatch, tmp_path) -> None:
    import importlib.util

    from kvforge.tools import bench

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran before --plot was checked")

    monkeypatch.setattr(bench, "run_bench", never)
    folder = str(exported("llama-tiny"))
    bad_suffix = CliRunner().invoke(main, ["bench", folder, "--plot", str(tmp_path / "x.jpg")])
    assert bad_suffix.exit_code == 2 and "give a path ending in .png" in bad_suffix.stderr
    no_folder = CliRunner().invoke(main, ["bench", folder, "--plot", str(tmp_path / "missing" / "x.png")])
    assert no_folder.exit_code == 2 and "does not exist" in no_folder.stderr
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    result = CliRunner().invoke(main, ["bench", folder, "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "--plot needs matplotlib: pip install -e '.[bench]'" in result.stderr


def test_a_quantised_gguf_exported_to_fp32_gets_a_hint() -> None:
    manifest = {"dtype": "fp32", "files": {"model.weights": {"bytes": 538_000_000}, "prefill.onnx": {"bytes": 1}},
                "model": {"source_gguf": {"bytes": 98_362_432, "tensor_types": {"F32": 61, "Q4_1": 210, "Q8_0": 1}}}}
    hint = dequantised_hint(manifest)
    assert hint == ("note: the GGUF's Q4_1/Q8_0 weights (98.4 MB) were dequantised to fp32 (538.0 MB); "
                    "--quantize int4 (target ort) carries its Q4_1/Q8_0 blocks over as they are")
    assert dequantised_hint({**manifest, "quantization": {"bits": 4}}) is None
    assert dequantised_hint({**manifest, "model": {"source_gguf": {"bytes": 1, "tensor_types": {"F32": 3}}}}) is None
    assert dequantised_hint({**manifest, "model": {}}) is None


def test_server_says_how_many_choices_it_takes(exported) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvforge.serve.app import create_app

    with TestClient(create_app(exported("llama-tiny", "ort"), max_batch=1, max_seq_len=64)) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "n": 17})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "'n' must be between 1 and 16, got 17"


def test_demo_says_what_its_counts_and_times_cover(tmp_path) -> None:
    result = CliRunner().invoke(main, ["demo", "-o", str(tmp_path / "demo"), "--recipe", "demo-llama",
                                       "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "8 tokens generated" in result.stdout
    timings = next(line for line in result.stdout.splitlines() if line.startswith("timings:"))
    assert timings.startswith("timings:   export ") and "time to first token" in timings
    # Every progress line is stamped with the time since the command began.
    progress = [line for line in result.stderr.splitlines() if line.startswith("[kvforge] ")]
    assert progress and all(line.startswith("[kvforge] [") for line in progress)
    assert any("load, trace, optimise and write took" in line for line in progress)


def test_what_readme_creates_in_a_checkout_is_ignored_by_git() -> None:
    from pathlib import Path

    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert ".venv/" in ignored and "kvforge-demo/" in ignored  # README's venv and the demo's cache


def test_parity_with_its_folders_swapped_says_the_order(tmp_path) -> None:
    # The export given as MODEL_DIR got "... a Hugging Face model folder, not a kvforge export: export it first"
    # (issue 43, 22). Decided from the folders alone, before any model loads.
    export, model = tmp_path / "my-export", tmp_path / "my-model"
    export.mkdir()
    model.mkdir()
    (export / "kvforge.json").write_text("{}")
    (model / "config.json").write_text('{"model_type": "llama"}')
    result = CliRunner().invoke(main, ["parity", str(export), str(model)])
    assert result.exit_code == 2
    assert result.stderr == (f"kvforge: error: {export} is a kvforge export and {model} is not: the arguments are "
                             f"swapped? The order is MODEL_DIR EXPORT_DIR: kvforge parity {model} {export}\n")
