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


def test_an_attention_bias_is_added_at_each_cache_position_in_both_references() -> None:
    """The op's optional `attention_bias` [B, H, S, C] (T5's relative bias): the torch reference and the numpy oracle
    agree, it is added to the scores of each cache position (checked against scores written out here), and it
    changes the output (a bias that were dropped would pass the first two checks with the causal softmax alone)."""
    import numpy as np

    from kvforge.core.contract import AttentionAttrs
    from kvforge.plugins.numpy_reference import kv_cache_attention_
    from kvforge.plugins.reference import kv_cache_attention

    generator = torch.Generator().manual_seed(0)
    batch, seq, heads, dim, capacity = 2, 3, 2, 4, 8
    q, k, v = (torch.randn(batch, seq, heads * dim, generator=generator) for _ in range(3))
    past = [torch.randn(batch, heads, capacity, dim, generator=generator) for _ in range(2)]
    lens = torch.tensor([0, 4], dtype=torch.int32)
    bias = torch.randn(batch, heads, seq, capacity, generator=generator)
    attrs = AttentionAttrs(heads, heads, 0.5)
    out, keys, values = kv_cache_attention(q, k, v, *past, lens, attrs, attention_bias=bias)
    oracle = kv_cache_attention_(*(x.numpy().copy() for x in (q, k, v, *past, lens)), attrs,
                                 attention_bias=bias.numpy())
    np.testing.assert_allclose(out.numpy(), oracle, atol=1e-5, rtol=0)
    for b in range(batch):
        for t in range(seq):
            seen = int(lens[b]) + t + 1
            query = q[b, t].view(heads, dim)
            scores = torch.einsum("hd,hcd->hc", query, keys[b, :, :seen]) * 0.5 + bias[b, :, t, :seen]
            expected = torch.einsum("hc,hcd->hd", torch.softmax(scores, -1), values[b, :, :seen]).reshape(-1)
            torch.testing.assert_close(out[b, t], expected, atol=1e-5, rtol=0)
    plain, _, _ = kv_cache_attention(q, k, v, *past, lens, attrs)
    assert (plain - out).abs().max() > 1e-2
