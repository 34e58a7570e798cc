"""Multimodal checkpoints (a text decoder inside vision / audio towers, `...ForConditionalGeneration`): kvforge
exports their text model (kvforge/exporter/text_model.py), built from the text config and loaded from the
language-model tensors alone, checks it at parity against HF's text model built the same way, records in the
manifest where it came from, and refuses a checkpoint whose text model it does not support, naming that model."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.exporter.export import export_model  # noqa: E402
from kvforge.exporter.load import load_hf_config, load_hf_model  # noqa: E402
from kvforge.models.coverage_data import load_coverage  # noqa: E402
from kvforge.tools.coverage_fixtures import build_tiny  # noqa: E402

IDS = [[1, 5, 9, 42, 7, 3, 200, 17]]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration checkpoint (vision tower, projector, text model) and the model."""
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    return folder, build_tiny("gemma3", folder)


def _stored_names(folder) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            names |= set(handle.keys())
    return names


def test_the_loader_builds_the_text_model_from_the_language_model_tensors_alone(gemma3, monkeypatch) -> None:
    import safetensors
    import torch
    from transformers.models.siglip import modeling_siglip

    folder, full = gemma3
    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:  # safe_open, recording which tensors are read
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    def no_tower(*args, **kwargs):
        raise AssertionError("the loader built the vision tower")

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    monkeypatch.setattr(modeling_siglip.SiglipVisionModel, "__init__", no_tower)
    model = load_hf_model(folder)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not any("vision" in name or "projector" in name for name, _ in model.named_parameters())
    stored = _stored_names(folder)
    towers = {name for name in stored if "vision_tower." in name or "multi_modal_projector." in name}
    assert towers, "the tiny checkpoint should hold its vision tower and projector"
    assert sorted(read) == sorted(stored - towers)  # every language-model tensor once, nothing of the towers
    # The text model computes what the whole checkpoint computes on tokens alone.
    with torch.no_grad():
        ids = torch.tensor(IDS)
        assert torch.allclose(model(ids).logits, full(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize("model_type", ["emu3", "mllama", "phi4_multimodal"])
def test_each_wrappers_text_model_computes_what_the_checkpoint_computes_on_tokens(model_type, tmp_path) -> None:
    # Emu3 keeps its text model under text_model., Mllama's has a cross-attention layer that a tokens-only
    # forward skips, Phi-4-multimodal is a Phi-3 decoder with its towers inside its embedding. (The loader's
    # part; whether kvforge exports emu3 / mllama is the coverage sweep's word: kvforge/data/coverage.json.)
    import torch

    from kvforge.exporter.text_model import load_text_model

    full = build_tiny(model_type, tmp_path / "hf")
    model = load_text_model(tmp_path / "hf")
    assert not any(tower in name for name, _ in model.named_parameters()
                   for tower in ("vision", "vqmodel", "audio", "embed_tokens_extend", "projector", "cross_attn"))
    with torch.no_grad():
        ids = torch.tensor(IDS)
        torch.testing.assert_close(model(ids).logits, full(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_the_text_model_exports_at_parity_and_the_manifest_says_where_it_came_from(gemma3, target, tmp_path) -> None:
    from kvforge.core.manifest import load_manifest
    from kvforge.tools.parity import run_parity

    folder, full = gemma3
    out = tmp_path / "out"
    export_model(folder, out, target=target, text_only=True)  # whole, gemma3 exports vision.onnx too
    model = load_manifest(out)["model"]
    assert model["text_of"] == {"model_type": "gemma3", "architecture": "Gemma3ForConditionalGeneration"}
    assert (model["model_type"], model["architecture"]) == ("gemma3_text", "Gemma3ForCausalLM")
    # `kvforge parity FOLDER EXPORT`: HF's text model built from the same checkpoint, tokens only.
    report = run_parity(folder, out, new_tokens=16, atol=1e-3, perplexity_tokens=0)
    assert report.passed, report.failure_reason()
    assert report.max_abs_err <= 1e-3
    for prompt in report.prompts:
        assert prompt.export_tokens == prompt.hf_generate_tokens and not prompt.mismatched_steps
    # And against the whole checkpoint's own tokens-only forward and generate.
    whole = run_parity(folder, out, new_tokens=16, atol=1e-3, perplexity_tokens=0, hf_model=full)
    assert whole.passed, whole.failure_reason()


def test_a_type_that_is_its_own_text_config_passes_parity_against_its_folder(tmp_path) -> None:
    # Phi-4-multimodal has no text_config: its export records its text type (phi3) and where it came from, and
    # `kvforge parity FOLDER EXPORT` takes the folder as the model the export was made from.
    from kvforge.core.manifest import load_manifest
    from kvforge.models.families import trial_registry
    from kvforge.tools.parity import run_parity

    model = build_tiny("phi4_multimodal", tmp_path / "hf")
    registry = trial_registry("phi4_multimodal", model.config.architectures[0], model.config)
    export_model(tmp_path / "hf", tmp_path / "out", target="ort", families=registry)
    recorded = load_manifest(tmp_path / "out")["model"]
    assert (recorded["model_type"], recorded["text_of"]["model_type"]) == ("phi3", "phi4_multimodal")
    report = run_parity(tmp_path / "hf", tmp_path / "out", new_tokens=8, perplexity_tokens=0)
    assert report.passed and report.max_abs_err < 1e-3, report.failure_reason()


def test_a_checkpoint_whose_text_model_kvforge_refuses_is_refused_naming_it(tmp_path) -> None:
    # Inkling 2's text model (inkling2_text) adds a position bias to its attention scores: refused before any
    # weight is read (its default config, saved without weights).
    from transformers import AutoConfig

    folder = tmp_path / "inkling2"
    AutoConfig.for_model("inkling2").save_pretrained(folder)
    reason = load_coverage()["types"]["inkling2_text"]["reason"]
    with pytest.raises(UnsupportedModelError) as caught:
        export_model(folder, tmp_path / "out", target="ort")
    message = str(caught.value)
    assert "inkling2_text" in message and "Inkling2ForConditionalGeneration" in message, message
    assert reason in message and "\n" not in message, message
    assert not (tmp_path / "out").exists()


def test_a_plain_causal_lm_is_loaded_as_before(hf_folder) -> None:
    from kvforge.exporter.text_model import text_of

    config = load_hf_config(hf_folder("llama-tiny"))
    assert config.model_type == "llama" and text_of(config) is None
