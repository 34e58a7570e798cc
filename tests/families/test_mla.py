"""Multi-head latent attention (DeepSeek-V3): values have fewer dims per head than keys (v_head_dim 8 against
qk_nope 8 + qk_rope 8 in the tiny config). The cache holds both at the key's head size, the values zero-padded
(exporter/wrapper.py), and the export must still match Hugging Face eager: parity, a batch of prompts of
different lengths, a prefill in chunks over the cache, and serving with chunked prefill and a second turn.

DeepSeek sparse attention (DeepSeek-V3.2: MLA plus an indexer that keeps the index_topk best cached positions per
query) runs the same checks against HF's own sparse attention, with index_topk cut to 96 so that the export's
capacity is capped there (models/families/deepseek_sparse.py): up to index_topk positions the indexer keeps them all."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from kvforge.core.contract import KVLayout, cache_input  # noqa: E402
from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.drivers.scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.xdist_group("mla")

TARGETS = ("ort", "onnx")
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
           "def main(): return 42"]


TOPK = 96  # DeepSeek-V3.2's index_topk in these tests (2048 in its real config)


def _build(model_type: str, folder):
    """The type's tiny model (build_tiny), DeepSeek-V3.2's with index_topk = TOPK, saved to `folder`."""
    from kvforge.tools.coverage_fixtures import build_tiny

    model = build_tiny(model_type, folder)
    if model_type == "deepseek_v32":
        model.config.index_topk = TOPK
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = TOPK
        model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def deepseek(request, tmp_path_factory):
    """The type's tiny config (keys of 16 dims per head, values of 8), exported once on each target."""
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry

    root = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, root / "hf")
    attention = model.model.layers[0].self_attn
    assert (attention.qk_head_dim, attention.v_head_dim) == (16, 8)  # the case under test: narrower values
    registry = trial_registry(request.param, type(model).__name__, model.config)  # as the coverage sweep tries it
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
    scheduler = Scheduler(Generator(root / "ort"), max_batch=2, max_seq_len=TOPK, prefill_chunk=5).start()
    try:
        served = check_two_turns(scheduler, solo, prompts)
        assert served == [_hf_greedy(model, p, n) for p, n in zip(prompts, (4, 9, 6), strict=True)]
    finally:
        scheduler.close()


def test_sparse_attention_exports_capped_at_index_topk_and_refuses_longer_rows(tmp_path) -> None:
    # Beyond index_topk positions HF's indexer drops some (its attention is then not the dense op's): the export
    # holds at most index_topk, says so, and a longer row is refused, not answered by another model.
    import torch

    from kvforge.core.errors import CapacityError
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry

    model = _build("deepseek_v32", tmp_path / "hf")
    said: list[str] = []
    registry = trial_registry("deepseek_v32", type(model).__name__, model.config)
    export_model(tmp_path / "hf", tmp_path / "ort", target="ort", families=registry, progress=said.append)
    assert KVLayout.from_manifest(load_manifest(tmp_path / "ort")).max_capacity == TOPK
    assert any(f"capacity capped at index_topk={TOPK}" in line for line in said), said
    with pytest.raises(CapacityError):
        Generator(tmp_path / "ort").generate([list(range(1, TOPK + 2))], max_new_tokens=1, greedy=True)
    # the cap is needed: past index_topk positions HF's sparse attention is not dense attention
    ids = torch.tensor([list(range(1, TOPK + 20))])
    with torch.no_grad():
        sparse = model(ids).logits[0, -1]
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 10 * TOPK
        dense = model(ids).logits[0, -1]
    assert (sparse - dense).abs().max() > 1e-3


def test_an_indexer_without_the_adapter_is_refused_in_one_line() -> None:
    # A sparse-attention model reached without its adapter (a type without a family module in models/families/)
    # must not be probed as dense attention.
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.probe import probe_attention
    from kvforge.tools.coverage_fixtures import DSA, tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("glm_moe_dsa"))
    with pytest.raises(UnsupportedModelError, match="DeepSeek sparse attention") as refused:
        probe_attention(model)
    assert str(refused.value) == f"glm_moe_dsa: {DSA}"
