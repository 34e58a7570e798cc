"""Every supported family and target against Hugging Face eager (fp32, random seeded weights).

Stated tolerance: max abs logit error <= 1e-3 at prefill and every decode step (we see ~1e-5),
and exact greedy token agreement for 32 new tokens, teacher-forced and via HF's own generate().
The "shared" session mode (decode steps on decode.onnx, not the default) is checked over 8 new
tokens: the same graph code at S=1, so fewer steps keep CI's time for the default path.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvforge.models.recipes import FAMILY_RECIPES  # noqa: E402  (tests/families/test_families.py: one per family)
from kvforge.tools.parity import run_parity  # noqa: E402

ATOL_FP32 = 1e-3


@pytest.mark.parametrize("sessions", ["shared", "single"])  # decode.onnx; decode steps via prefill.onnx
@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_family_matches_hf_eager(recipe: str, target: str, sessions: str, hf_folder, exported) -> None:
    new_tokens = 32 if sessions == "single" else 8
    report = run_parity(hf_folder(recipe), exported(recipe, target), new_tokens=new_tokens, atol=ATOL_FP32,
                        sessions=sessions)
    for prompt in report.prompts:
        assert len(prompt.export_tokens) == new_tokens
        assert prompt.max_abs_err <= ATOL_FP32, (recipe, target, prompt.step_max_abs_err)
        assert prompt.mismatched_steps == [] and prompt.tie_steps == []
        assert prompt.generate_equal  # HF's generate(); it may stop at an EOS the export runs past
    assert report.passed, report.summary()


@pytest.mark.parametrize("recipe", ["llama-tiny", "gemma-tiny", "olmo2-tiny", "gemma3-tiny"])
def test_fp16_export_matches_hf_fp16(recipe, hf_folder, exported) -> None:
    # fp16 runs on ONNX Runtime CPU too; HF eager in fp16 is the reference. Stated atol: 0.15. Gemma's and
    # OLMo 2's norms multiply by their weight in fp32 inside an fp16 model: the fused norms must still load
    # (exporter/fusions.py: align_norm_dtypes).
    report = run_parity(hf_folder(recipe), exported(recipe, "ort", "fp16"), new_tokens=32)
    assert report.atol == 0.15
    assert report.max_abs_err <= 0.15, report.summary()
    assert all(not p.mismatched_steps for p in report.prompts), report.summary()


def test_parity_gate_fails_on_a_different_model(hf_folder, exported) -> None:
    # The gate must be able to fail: llama-tiny's export against llama3-tiny's weights.
    report = run_parity(hf_folder("llama3-tiny"), exported("llama-tiny", "ort"), new_tokens=8, atol=ATOL_FP32)
    assert not report.passed
    assert "max logit error" in report.failure_reason()
