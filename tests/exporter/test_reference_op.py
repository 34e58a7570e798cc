"""The fused op's torch reference, routed into HF's modules, against HF's own eager attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvforge.exporter.load import load_hf_model  # noqa: E402
from kvforge.exporter.wrapper import GraphWrapper  # noqa: E402


@pytest.mark.parametrize("recipe", ["mistral-tiny", "qwen3-tiny"])
def test_wrapper_prefill_then_chunk_matches_hf(recipe: str, hf_folder) -> None:
    # mistral-tiny's 16-token window is shorter than the 30 tokens used here, so the window matters.
    model = load_hf_model(hf_folder(recipe))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ids = torch.arange(3, 33).reshape(1, 30)
    capacity = 40
    cache = [torch.zeros(1, config.num_key_value_heads, capacity, head_dim) for _ in range(2 * config.num_hidden_layers)]
    with torch.no_grad():
        reference = model(ids).logits[0]  # HF eager, whole sequence, no cache
        prefill = GraphWrapper(model, "prefill")
        first = prefill(ids[:, :20], torch.tensor([0], dtype=torch.int32), torch.tensor([[19]]), *cache)
        second = prefill(ids[:, 20:], torch.tensor([20], dtype=torch.int32), torch.tensor([[9]]), *first[1:])
        decode = GraphWrapper(model, "decode")
        step = decode(ids[:, 29:30], torch.tensor([29], dtype=torch.int32), *second[1:])
    torch.testing.assert_close(first[0][0, 0], reference[19], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[0][0, 0], reference[29], atol=1e-4, rtol=0)
    # Re-feeding token 29 at position 29 overwrites the same cache row: same logits again.
    torch.testing.assert_close(step[0][0], reference[29], atol=1e-4, rtol=0)
    # The model object still serves as the HF eager reference after the wrapper ran.
    assert model.config._attn_implementation == "eager"
