"""Every supported family and target against Hugging Face eager (fp32, random seeded weights).

Stated tolerance: max abs logit error <= 1e-3 at prefill and every decode step (we see ~1e-5),
and exact greedy token agreement for 32 new tokens, teacher-forced and via HF's own generate().
The "shared" session mode (decode steps on decode.onnx, not the default) is checked over 8 new
tokens: the same graph code at S=1, so fewer steps keep CI's time for the default path. A recipe's four
runs share one Hugging Face eager reference (kvforge/tools/parity_reference.py), made once per worker: the
same numbers as four runs that each compute it (test_a_shared_reference_gives_the_same_report).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.models.recipes import FAMILY_RECIPES  # noqa: E402  (tests/families/test_families.py: one per family)
from kvforge.tools.parity import run_parity  # noqa: E402
from kvforge.tools.parity_reference import hf_reference  # noqa: E402

ATOL_FP32 = 1e-3


@pytest.fixture(scope="module")
def reference(hf_folder):
    """reference(recipe, export) -> HF eager's side of the recipe's parity runs (32 new tokens: the 8-token runs
    use its prefixes), made once per worker; a recipe's runs are one xdist group, so they share it."""
    made = {}

    def get(recipe: str, export):
        if recipe not in made:
            made[recipe] = hf_reference(hf_folder(recipe), export, new_tokens=32)
        return made[recipe]

    return get


@pytest.mark.parametrize("sessions", ["shared", "single"])  # decode.onnx; decode steps via prefill.onnx
@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("recipe", [pytest.param(recipe, marks=pytest.mark.xdist_group(f"parity-{recipe}"))
                                    for recipe in FAMILY_RECIPES])
def test_family_matches_hf_eager(recipe: str, target: str, sessions: str, hf_folder, exported, reference) -> None:
    new_tokens = 32 if sessions == "single" else 8
    export = exported(recipe, target)
    report = run_parity(hf_folder(recipe), export, new_tokens=new_tokens, atol=ATOL_FP32, sessions=sessions,
                        reference=reference(recipe, export))
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


def test_a_shared_reference_gives_the_same_report(hf_folder, exported) -> None:
    # The reference is HF's side computed once: every field of a report made with it (at its 8 new tokens and at a
    # prefix of 4) is the one a run that computes HF itself gives. Runs it was not made for are refused in one line.
    folder, export = hf_folder("llama-tiny"), exported("llama-tiny", "onnx")
    ref = hf_reference(folder, exported("llama-tiny", "ort"), new_tokens=8, perplexity_tokens=300)
    for new_tokens in (8, 4):
        alone = run_parity(folder, export, new_tokens=new_tokens, perplexity_tokens=300)
        shared = run_parity(folder, export, new_tokens=new_tokens, perplexity_tokens=300, reference=ref)
        assert shared.to_dict() == alone.to_dict() and alone.passed
        assert [p.hf_generate_tokens for p in shared.prompts] == [list(g[:new_tokens]) for g in ref.generated]
    # A model whose generate() prefixes are not known to be exact (a static cache, a forced EOS) has HF generate
    # again for fewer new tokens: the same report.
    assert ref.prefix_exact
    again = run_parity(folder, export, new_tokens=4, perplexity_tokens=300, reference=replace(ref, prefix_exact=False))
    assert again.to_dict() == alone.to_dict()
    refusals = {
        "made from": dict(model_dir=hf_folder("llama3-tiny")),
        "prompts, prompt_ids differ": dict(prompts=["another prompt"]),
        "holds 8 new tokens per prompt, and this run asks 9": dict(new_tokens=9),
        "perplexity text (64 tokens; the reference has 300)": dict(perplexity_tokens=64),
    }
    for message, change in refusals.items():
        arguments = {"model_dir": folder, "export_dir": export, "new_tokens": 8, "perplexity_tokens": 300, **change}
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run_parity(**arguments, reference=ref)
