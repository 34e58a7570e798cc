"""Export adapters (the family modules of kvforge/models/families/): the causal-LM families whose attention is written into their own
modeling code (Falcon, GPT-Neo, XGLM, ...) are routed through transformers' attention interface, and the
families whose rotary embedding is complex-valued (Llama 4, DeepSeek-V2) get its real-valued form, so that
kvforge's fused attention op is what the export traces. Each adapted model must equal HF eager."""

from __future__ import annotations

import copy
from pathlib import Path
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from kvforge.tools import coverage_fixtures as coverage  # noqa: E402
from kvforge.tools.coverage_fixtures import ATOL, PROMPTS, tiny_config  # noqa: E402

pytestmark = pytest.mark.xdist_group("adapters")

# The families the adapters make exportable, each at its sweep size with the options its adapter maps:
# Falcon in its three head layouts, GPT-Neo with a window short enough to matter, Llama 4 with a RoPE
# (chunked) layer and a NoPE layer whose temperature tuning changes every 4 positions.
LLAMA4 = {"no_rope_layers": [1, 0], "layer_types": ["chunked_attention", "full_attention"], "floor_scale": 4,
          "attention_chunk_size": 64}
VARIANTS: dict[str, tuple[str, dict]] = {
    "falcon": ("falcon", {}),
    "falcon-mha": ("falcon", {"multi_query": False}),
    "falcon-gqa": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "gpt_neo": ("gpt_neo", {"window_size": 8}),
    "gptj": ("gptj", {}),
    "codegen": ("codegen", {}),
    "xglm": ("xglm", {}),
    "openai-gpt": ("openai-gpt", {}),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}),
    "git": ("git", {}),
    "llama4_text": ("llama4_text", LLAMA4),
    "deepseek_v2": ("deepseek_v2", {}),
    # ALiBi, at the sweep's 4 heads and at 6 (not a power of two: BLOOM and MPT make their slopes differently),
    # MPT also with clip_qkv.
    "bloom": ("bloom", {}),
    "bloom-6": ("bloom", {"hidden_size": 96, "n_head": 6}),
    "mpt": ("mpt", {}),
    "mpt-6": ("mpt", {"d_model": 96, "n_heads": 6}),
    "mpt-clip": ("mpt", {"attn_config": {"clip_qkv": 0.5}}),
}


def _config(name: str):
    model_type, overrides = VARIANTS[name]
    config = tiny_config(model_type)
    for key, value in overrides.items():
        nested = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(nested, "to_dict"):  # a nested config (MPT's attn_config)
            for name, item in value.items():
                setattr(nested, name, item)
        else:
            setattr(config, key, value)
    return config


def _tiny(name: str, folder: Path):
    """coverage.build_tiny's seeded model and folder, with the variant's config."""
    config = _config(name)
    with mock.patch.object(coverage, "tiny_config", lambda *_args, **_kw: config):
        return coverage.build_tiny(VARIANTS[name][0], folder)


# -- the real-valued rotary -----------------------------------------------------------------------------------


def test_the_real_valued_rotary_equals_the_complex_one_on_random_inputs() -> None:
    from kvforge.models.families.surgery import rotate_pairs

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=generator)  # [B, S, H, D]: pairs (x[2i], x[2i+1])
    freqs = torch.rand(3, 5, 8, generator=generator) * 50.0  # large angles too
    scale = 1.3
    complex_ = torch.polar(torch.ones_like(freqs), freqs) * scale
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(3, 5, 4, 8, 2)) * complex_[:, :, None, :]).flatten(3)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    got = rotate_pairs(x, cos[:, :, None, :], sin[:, :, None, :])
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and HF's own complex helpers (Llama 4 broadcasts over heads itself, DeepSeek-V2 over BNSH's heads)
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb as deepseek_rotary
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as llama4_rotary

    q, k = x, torch.randn(3, 5, 2, 16, generator=generator)
    for ours, theirs in zip((rotate_pairs(q, cos[:, :, None], sin[:, :, None]), rotate_pairs(k, cos[:, :, None], sin[:, :, None])),
                            llama4_rotary(q, k, complex_), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # BNSH
    for ours, theirs in zip((rotate_pairs(q, cos[:, None], sin[:, None]), rotate_pairs(k, cos[:, None], sin[:, None])),
                            deepseek_rotary(q, k, complex_), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# -- each adapter against HF eager, without exporting ------------------------------------------------------


def _causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      **_kwargs):
    """What kvforge's op computes for one uncached call: causal (and windowed) attention over the call's own
    keys, GQA by repeating key heads, values of their own head size."""
    heads, seq, head_dim = query.shape[1], query.shape[2], query.shape[3]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * (head_dim**-0.5 if scaling is None else scaling)
    rows, cols = torch.arange(seq)[:, None], torch.arange(key.shape[2])[None]
    slopes = getattr(module, "alibi_slopes", None)
    if slopes is not None:  # ALiBi as HF adds it: slope * key position (the op adds slope * (key - query))
        scores = scores + slopes[:, None, None] * cols
    allowed = cols <= rows
    if sliding_window:
        allowed &= cols > rows - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


ADAPTED = ["falcon", "falcon-mha", "falcon-gqa", "gpt_neo", "xglm", "openai-gpt", "gpt_neox_japanese", "git",
           "llama4_text", "deepseek_v2", "bloom", "bloom-6", "mpt", "mpt-6", "mpt-clip"]


@pytest.fixture(scope="module")
def causal_implementation():
    from transformers import AttentionInterface

    AttentionInterface.register("kvforge_test_causal", _causal_attention)
    return "kvforge_test_causal"


@pytest.mark.parametrize("name", ADAPTED)
def test_an_adapted_model_equals_hf_eager_through_the_attention_interface(name, causal_implementation) -> None:
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.probe import probe_attention
    from kvforge.models.families import family_modules
    from kvforge.models.families.surgery import Patches

    config = _config(name)
    if name == "gpt_neo":
        config.window_size = 4  # shorter than the input: the local layer's window decides
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    adapted = copy.deepcopy(hf)
    family = family_modules()[config.model_type]
    assert family.patch is not None
    family.patch(adapted, Patches())  # never closed: the copy stays adapted
    ids = torch.randint(4, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        # Under HF's own implementation the adapted model is still HF's model (the parity reference may be either).
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        adapted.config._attn_implementation = causal_implementation
        routed = adapted(input_ids=ids).logits
    torch.testing.assert_close(routed, expected, atol=1e-4, rtol=1e-4)
    # ... and every layer now calls attention through the interface, under its own index.
    adapted.config._attn_implementation = "eager"
    assert sorted(probe_attention(adapted)) == list(range(config.num_hidden_layers))


def test_a_family_without_an_adapter_is_left_as_it_is() -> None:
    from transformers import AutoModelForCausalLM

    from kvforge.core.contract import KVLayout
    from kvforge.exporter.graphs import adapt_for_export
    from kvforge.models.families import families
    from kvforge.models.families.surgery import Patches

    model = AutoModelForCausalLM.from_config(tiny_config("gptj")).eval()
    forwards = [module.forward for module in model.modules()]
    layout = KVLayout(2, 2, 16, "float32", 2048)
    with Patches() as patches:
        assert adapt_for_export(model, families()["gptj"], layout, patches, print) == layout
    assert [module.forward for module in model.modules()] == forwards


def test_falcon_with_alibi_is_refused_naming_alibi() -> None:
    from transformers import AutoModelForCausalLM

    from kvforge.core.errors import UnsupportedModelError
    from kvforge.models.families import families

    config = tiny_config("falcon")
    config.alibi = True
    AutoModelForCausalLM.from_config(config)  # a model HF builds; kvforge refuses it when checking the family
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        families()["falcon"].check(config)


def test_llama4_caps_the_capacity_at_its_attention_chunk() -> None:
    from transformers import AutoModelForCausalLM

    from kvforge.core.contract import KVLayout
    from kvforge.exporter.graphs import adapt_for_export
    from kvforge.models.families import family_modules
    from kvforge.models.families.surgery import Patches

    family = family_modules()["llama4_text"]
    model = AutoModelForCausalLM.from_config(_config("llama4_text")).eval()
    layout = KVLayout(2, 2, 16, "float32", 2048)
    notes: list[str] = []
    with Patches() as patches:
        assert adapt_for_export(model, family, layout, patches, notes.append).max_capacity == 64
    assert any("attention_chunk_size" in note for note in notes)
    model.config.attention_chunk_size = None  # no chunked layers: nothing to cap
    with Patches() as patches:
        fresh = AutoModelForCausalLM.from_config(model.config).eval()
        assert adapt_for_export(fresh, family, layout, patches, notes.append) == layout


# -- exported on ort (and onnx), against HF eager ----------------------------------------------------------------

# (variant, target). ALiBi (BLOOM, MPT) on both targets that lower it, BLOOM also with 6 heads.
EXPORTED = [(name, "ort") for name in ("falcon", "gptj", "gpt_neo", "codegen", "llama4_text")] + [
    ("bloom", "ort"), ("bloom", "onnx"), ("mpt", "ort"), ("mpt", "onnx"), ("bloom-6", "ort")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(name, target) -> (folder with hf/ and the export in <target>/, the HF eager model): each made once
    per module."""
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry

    made: dict[str, tuple[Path, object]] = {}

    def get(name: str, target: str = "ort") -> tuple[Path, object]:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            made[name] = (root, _tiny(name, root / "hf"))
        root, model = made[name]
        if not (root / target).exists():
            registry = trial_registry(model.config.model_type, type(model).__name__, model.config)
            export_model(root / "hf", root / target, target=target, families=registry)
        return root, model

    return get


@pytest.mark.parametrize(("name", "target"), EXPORTED)
def test_the_export_equals_hf_eager_and_a_batch_equals_each_prompt_alone(exported, name, target) -> None:
    from kvforge.runtime import Generator
    from kvforge.tools.parity import run_parity

    root, model = exported(name, target)
    report = run_parity(root / "hf", root / target, list(PROMPTS), 24, ATOL, perplexity_tokens=0, hf_model=model)
    assert report.passed, report.failure_reason()
    generator = Generator(root / target)
    ids = [generator.tokenizer.encode(text) for text in PROMPTS]
    batch = generator.generate(ids, max_new_tokens=12, greedy=True, ignore_eos=True).tokens
    assert batch == [generator.generate([row], max_new_tokens=12, greedy=True, ignore_eos=True).tokens[0]
                     for row in ids]


def test_llama4_exports_at_most_its_attention_chunk_and_says_so_past_it(exported) -> None:
    from kvforge.core.errors import CapacityError
    from kvforge.core.manifest import load_manifest
    from kvforge.runtime import Generator

    root, _ = exported("llama4_text")
    assert load_manifest(root / "ort")["kv_cache"]["max_capacity"] == LLAMA4["attention_chunk_size"]
    generator = Generator(root / "ort")
    ids = generator.tokenizer.encode(PROMPTS[1])
    with pytest.raises(CapacityError):
        generator.generate([ids], max_new_tokens=64, greedy=True, ignore_eos=True)


@pytest.mark.parametrize(("name", "target"), [("falcon", "ort"), ("bloom", "ort"), ("bloom", "onnx"), ("mpt", "ort"),
                                             ("mpt", "onnx")])
def test_served_with_chunked_prefill_and_a_second_turn_equals_each_alone(exported, name, target) -> None:
    from serving import check_two_turns

    from kvforge.runtime import Generator
    from kvforge.runtime.drivers.scheduler import Scheduler

    root, _ = exported(name, target)
    solo = Generator(root / target)
    prompts = [solo.tokenizer.encode(text) for text in PROMPTS]
    scheduler = Scheduler(Generator(root / target), max_batch=2, max_seq_len=128, prefill_chunk=5).start()
    try:
        check_two_turns(scheduler, solo, prompts)
    finally:
        scheduler.close()


def test_gemma3n_sparse_mlps_equal_hf_with_the_quantile_a_constant() -> None:
    # HF's Normal.icdf (erfinv) has no ONNX form: the E4B-shaped export failed (issue 43). The adapter computes the
    # quantile once; the MLP must still compute HF's function.
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.models.families import family_modules
    from kvforge.models.families.surgery import Patches

    config = tiny_config("gemma3n_text")
    assert list(config.activation_sparsity_pattern) == [0.95, 0.95, 0.0, 0.0]  # the sweep keeps it on
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mlps = [layer.mlp for layer in model.model.layers]
    inputs = torch.randn(2, 5, config.hidden_size)
    with torch.no_grad():
        want = [mlp(inputs) for mlp in mlps]
        patches = Patches()
        said = family_modules()["gemma3n_text"].patch(model, patches)
        got = [mlp(inputs) for mlp in mlps]
    assert said == ("activation sparsity's normal quantile computed once at export (erfinv has no ONNX form) "
                    "(2 layers)")
    assert mlps[0]._kvforge_z == pytest.approx(1.6448536, abs=1e-6)  # the standard normal's 95th percentile
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
