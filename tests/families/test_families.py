"""The family registry: every family has a parity-tested recipe, batches match single prompts on
every target, the features the parity tests rely on really change HF's output at the tested
lengths, unsupported options fail at export naming the option, and README's table is the registry's.

(Per-family parity against Hugging Face eager: tests/exporter/test_export_parity.py and, for the `trt`
target through the CPU emulation, tests/engines/test_trt_target.py; both run every FAMILY_RECIPES entry.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.exporter.export import export_model
from kvforge.exporter.load import load_hf_model  # noqa: E402
from kvforge.models.families import families, family_for, support_table  # noqa: E402
from kvforge.models.recipes import FAMILY_RECIPES, build_model  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_registered_family_has_a_parity_tested_recipe() -> None:
    covered: dict[str, set[str]] = {}
    for name in FAMILY_RECIPES:
        model = build_model(name)
        family = family_for(model.config)  # the recipe's model really is what the family registers
        assert type(model).__name__ in family.architectures, name
        covered.setdefault(family.model_type, set()).add(type(model).__name__)
    for model_type, family in families().items():
        if family.swept:  # registered by the coverage sweep: tests/families/test_coverage.py
            continue
        assert covered.get(model_type) == set(family.architectures), f"{model_type} has no parity-tested recipe"


def test_readme_table_is_the_registry() -> None:
    assert support_table() in README.read_text(), "README's family table drifted: paste kvforge.models.families.support_table()"


# Three prompts of different lengths; the longest passes the 16-token sliding windows of the recipes.
BATCH_PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 300, 12, 12, 8, 90, 61, 33, 3, 400, 150]]


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_batched_prompts_of_different_lengths_match_each_alone(recipe: str, target: str, exported) -> None:
    generator = Generator(exported(recipe, target))
    batch = generator.generate(BATCH_PROMPTS, max_new_tokens=24, greedy=True, ignore_eos=True)
    for row, prompt in enumerate(BATCH_PROMPTS):
        alone = generator.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True)
        assert batch.tokens[row] == alone.tokens[0], (recipe, target, row)


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("recipe", ["gemma2-tiny", "gemma3-tiny", "mistral-tiny"])
def test_the_sliding_window_changes_hf_logits_at_the_tested_lengths(recipe: str, hf_folder) -> None:
    # The parity tests generate 32 tokens after prompts of up to 23: past the 16-token window. If the
    # window did not change HF's logits there, parity could not catch an export that ignores it.
    model = load_hf_model(hf_folder(recipe))
    ids = list(range(3, 3 + 48))
    windowed = _hf_logits(model, ids)
    model.config.sliding_window = 4096
    for layer in model.base_model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 4096
    unwindowed = _hf_logits(model, ids)
    assert np.abs(windowed[:16] - unwindowed[:16]).max() < 1e-5  # inside the window: the same
    assert np.abs(windowed[20:] - unwindowed[20:]).max() > 1e-2  # beyond it: parity would fail at 1e-3


@pytest.mark.parametrize("recipe", ["gemma2-tiny", "gemma3-tiny", "granite-tiny"])
def test_the_post_lm_head_logit_transform_matters(recipe: str, hf_folder) -> None:
    # Final-logit soft-capping (Gemma 2/3) and logits_scaling (Granite) happen outside HF's backbone;
    # the export applies them through the family adapter. Without them the logits are far off.
    model = load_hf_model(hf_folder(recipe))
    ids = list(range(3, 20))
    with torch.no_grad():
        hidden = model.base_model(torch.tensor([ids])).last_hidden_state
        raw = model.lm_head(hidden)[0].float().numpy()
        finished = family_for(model.config).finish_logits(model.config, model.lm_head(hidden))[0].float().numpy()
    reference = _hf_logits(model, ids)
    np.testing.assert_allclose(finished, reference, atol=1e-5)
    assert np.abs(raw - reference).max() > 0.1


def _edited_copy(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("recipe", "changes", "message"),
    [
        ("llama-tiny", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
         "llama: rope type 'dynamic' is not supported; kvforge exports rope types default, linear, llama3, yarn, longrope"),
        ("gemma3-tiny", {"use_bidirectional_attention": True},
         "gemma3_text: use_bidirectional_attention=True is not supported"),
        ("gpt2-tiny", {"scale_attn_by_inverse_layer_idx": True},
         "gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"),
    ],
    ids=["rope-dynamic", "gemma3-bidirectional", "gpt2-inverse-layer-scaling"],
)
def test_unsupported_option_of_a_supported_family_fails_at_export(recipe, changes, message, hf_folder, tmp_path) -> None:
    folder = _edited_copy(hf_folder(recipe), tmp_path / "model", **changes)
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_model(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()



def test_a_head_size_gqa_cannot_take_is_refused_on_ort_at_export(tmp_path) -> None:
    # ONNX Runtime's GroupQueryAttention takes head sizes that are multiples of 8 (GLM-4.5-MoE's default
    # config has 4096 / 96 = 42): the export says so and names the target that takes it, instead of
    # writing graphs that fail when run.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(UnsupportedModelError, match="qwen3: its head size 12 is not a multiple of 8, which --target "
                                                    "ort's attention .*; use --target onnx$"):
        export_model(tmp_path / "hf", tmp_path / "out", target="ort")
    assert not (tmp_path / "out").exists()


def test_gemma2_attention_softcap_changes_hf_logits(hf_folder) -> None:
    # gemma2-tiny soft-caps attention scores at 5: far from a no-op, so parity checks the cap.
    model = load_hf_model(hf_folder("gemma2-tiny"))
    ids = list(range(3, 40))
    capped = _hf_logits(model, ids)
    model.config.attn_logit_softcapping = None
    for layer in model.base_model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert np.abs(capped - _hf_logits(model, ids)).max() > 0.1
