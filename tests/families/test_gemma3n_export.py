"""Gemma 3n with its real activation sparsity (E2B/E4B: 0.95 on the first layers' MLPs) exports, streamed, and
answers as Hugging Face eager. Its sparsity threshold is a normal quantile, whose erfinv has no ONNX form: the
export once failed with "No ONNX function found for prims.erf_inv" (issue 43)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvforge.tools import coverage_fixtures as coverage  # noqa: E402


def test_gemma3n_with_activation_sparsity_exports_streamed_and_matches_hf(tmp_path, monkeypatch) -> None:
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry
    from kvforge.tools.parity import run_parity

    config = coverage.tiny_config("gemma3n_text")
    # Set here, not taken from the sweep's config: this test holds whatever the sweep keeps. A per-layer-input
    # vocabulary as small as the vocabulary (HF's default, 262,144 rows x 4 layers, is 1 GB at test size).
    config.activation_sparsity_pattern = [0.95, 0.95] + [0.0] * (config.num_hidden_layers - 2)
    config.vocab_size_per_layer_input = config.vocab_size
    monkeypatch.setattr(coverage, "tiny_config", lambda _model_type, real=False: config)
    coverage.build_tiny("gemma3n_text", tmp_path / "hf")
    said: list[str] = []
    export_model(tmp_path / "hf", tmp_path / "out", progress=said.append,
                 families=trial_registry("gemma3n_text", "Gemma3nForCausalLM", config))
    # The adapter changes code, never a weight: an E4B-sized export must still stream its weights.
    assert any(line.startswith("streaming ") for line in said), said
    assert any("normal quantile" in line for line in said), said
    report = run_parity(tmp_path / "hf", tmp_path / "out", list(coverage.PROMPTS), coverage.NEW_TOKENS,
                        coverage.ATOL, perplexity_tokens=0)
    assert report.passed, report.failure_reason()  # logits within ATOL and the same greedy tokens as HF
