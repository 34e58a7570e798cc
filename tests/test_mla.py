"""Multi-head latent attention (DeepSeek-V3): values have fewer dims per head than keys (v_head_dim 8 against
qk_nope 8 + qk_rope 8 in the tiny config). The cache holds both at the key's head size, the values zero-padded
(exporter/wrapper.py), and the export must still match Hugging Face eager: parity, a batch of prompts of
different lengths, a prefill in chunks over the cache, and serving with chunked prefill and a second turn."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from kvforge.core.contract import KVLayout, cache_input  # noqa: E402
from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.xdist_group("mla")

TARGETS = ("ort", "onnx")
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
           "def main(): return 42"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """deepseek_v3's tiny config (keys of 16 dims per head, values of 8), exported once on each target."""
    from kvforge.exporter.export import export_model
    from kvforge.models.coverage import build_tiny
    from kvforge.models.families import trial_registry

    root = tmp_path_factory.mktemp("deepseek_v3")
    model = build_tiny("deepseek_v3", root / "hf")
    attention = model.model.layers[0].self_attn
    assert (attention.qk_head_dim, attention.v_head_dim) == (16, 8)  # the case under test: narrower values
    registry = trial_registry("deepseek_v3", type(model).__name__, model.config)  # as the coverage sweep tries it
    for target in TARGETS:
        export_model(root / "hf", root / target, target=target, families=registry)
    return root, model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF eager's greedy tokens, each from a full forward over the sequence so far (no cache)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_cache_holds_values_at_the_keys_head_size(deepseek) -> None:
    root, _ = deepseek
    for target in TARGETS:
        layout = KVLayout.from_manifest(load_manifest(root / target))
        assert set(layout.layer_shapes()) == {(4, 16)}, (target, layout)


@pytest.mark.parametrize("target", TARGETS)
def test_mla_exports_at_parity_and_a_batch_equals_each_alone(deepseek, target) -> None:
    from kvforge.tools.parity import run_parity

    root, model = deepseek
    report = run_parity(root / "hf", root / target, PROMPTS, 24, 1e-3, perplexity_tokens=0, hf_model=model)
    assert report.passed, report.failure_reason()
    assert report.max_abs_err <= 1e-3
    generator = Generator(root / target)
    ids = [generator.tokenizer.encode(text) for text in PROMPTS]
    batch = generator.generate(ids, max_new_tokens=12, greedy=True, ignore_eos=True).tokens
    assert batch == [generator.generate([row], max_new_tokens=12, greedy=True, ignore_eos=True).tokens[0]
                     for row in ids]


@pytest.mark.parametrize("target", TARGETS)
def test_a_prefill_in_chunks_over_the_cache_matches_hf_at_every_chunk(deepseek, target) -> None:
    # Prefill with past_lens > 0 (chunked prefill, a second turn): each chunk attends to the padded values the
    # chunks before it wrote into the cache; its logits must be HF eager's at the same positions.
    import onnxruntime as ort
    import torch

    root, model = deepseek
    folder = root / target
    layout = KVLayout.from_manifest(load_manifest(folder))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    prefill = ort.InferenceSession(str(folder / "prefill.onnx"), options, providers=["CPUExecutionProvider"])
    names = [output.name for output in prefill.get_outputs()]
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    cache = {cache_input(kind, layer): np.zeros(layout.buffer_shape(1, 32, layer, kind), np.float32)
             for layer, kind in layout.buffers()}
    done = 0
    for size in (5, 7, 1, 6):
        chunk = prompt[done:done + size]
        out = prefill.run(None, {"input_ids": np.array([chunk]), "past_lens": np.array([done], np.int32),
                                 "logits_index": np.array([[size - 1]]), **cache})
        cache = {name.replace("present", "past"): value for name, value in zip(names[1:], out[1:], strict=True)}
        done += size
        np.testing.assert_allclose(out[0].reshape(-1), want[done - 1], atol=1e-3, err_msg=f"after {done} tokens")
    assert done == len(prompt)


def test_serving_with_chunked_prefill_and_a_second_turn_equals_each_alone_and_hf(deepseek) -> None:
    from serving import check_two_turns

    root, model = deepseek
    solo = Generator(root / "ort")
    prompts = [solo.tokenizer.encode(text) for text in PROMPTS]
    scheduler = Scheduler(Generator(root / "ort"), max_batch=2, max_seq_len=128, prefill_chunk=5).start()
    try:
        served = check_two_turns(scheduler, solo, prompts)
        assert served == [_hf_greedy(model, p, n) for p, n in zip(prompts, (4, 9, 6), strict=True)]
    finally:
        scheduler.close()


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"])
def test_deepseek_sparse_attention_is_refused_not_exported_dense(model_type, tmp_path) -> None:
    # Its indexer keeps the top-k cached positions per query: kvforge's dense op would attend to all of them.
    from kvforge.exporter.export import export_model
    from kvforge.models.coverage import MISSING_FEATURES, build_tiny
    from kvforge.models.families import trial_registry

    model = build_tiny(model_type, tmp_path / "hf")
    registry = trial_registry(model_type, type(model).__name__, model.config)
    with pytest.raises(UnsupportedModelError) as refused:
        export_model(tmp_path / "hf", tmp_path / "out", target="ort", families=registry)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()
    assert "sparse attention" in MISSING_FEATURES[model_type] and "top-k" in MISSING_FEATURES[model_type]
