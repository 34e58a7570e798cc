"""ALiBi in kvforge's attention op (the canonical node's `alibi_slopes` input) and its lowerings: the `ort` target's
GroupQueryAttention attention_bias, the `onnx` target's additive Attention mask, and the `trt` target's refusal.
Each lowered graph runs on ONNX Runtime against a direct numpy ALiBi (HF's form: slope_h * key position added to
the scaled scores) with 6 query heads over 3 KV heads: a head count that is not a power of two, whose slopes
interleave a second geometric series. End-to-end parity of BLOOM and MPT is in tests/families/test_adapters.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
ir = pytest.importorskip("onnx_ir")

from kvforge.core.contract import CANONICAL_OP, INPUT_IDS, AttentionAttrs  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, SCALE = 6, 3, 8, 16, 0.3


def bloom_slopes(heads: int) -> np.ndarray:
    """The ALiBi paper's slopes (BLOOM's): a geometric series over the largest power of two <= heads, then every
    other term of the series of twice that many for the heads left."""
    def series(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(heads))
    return np.array(series(closest) + series(2 * closest)[0::2][: heads - closest], np.float32)


def alibi_attention(q, k, v, past_key, past_value, past_lens, slopes):
    """numpy: the rows written at past_lens[b] + t, then causal attention with HF's ALiBi (slope * key position)."""
    batch, seq, _ = q.shape
    keys, values = past_key.copy(), past_value.copy()
    out = np.zeros_like(q)
    group = HEADS // KV_HEADS
    for b in range(batch):
        start = int(past_lens[b])
        keys[b, :, start:start + seq] = k[b].reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        values[b, :, start:start + seq] = v[b].reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        for h in range(HEADS):
            for t in range(seq):
                n = start + t + 1
                scores = keys[b, h // group, :n] @ q[b, t, h * HEAD_DIM:(h + 1) * HEAD_DIM] * SCALE
                scores = scores + slopes[h] * np.arange(n)
                p = np.exp(scores - scores.max())
                out[b, t, h * HEAD_DIM:(h + 1) * HEAD_DIM] = (p / p.sum()) @ values[b, h // group, :n]
    return out, keys, values


def canonical_model(seq: int | None, slopes: np.ndarray) -> ir.Model:
    """One canonical node (sinks absent, alibi_slopes given) over graph inputs; `seq` 1 adds decode.onnx's
    input_ids [B, 1], which is how the `ort` lowering tells a decode graph."""
    import onnx
    from onnx import TensorProto, helper

    s = seq if seq is not None else "S"
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in (
        ("q", ["B", s, HEADS * HEAD_DIM]), ("k", ["B", s, KV_HEADS * HEAD_DIM]), ("v", ["B", s, KV_HEADS * HEAD_DIM]),
        ("past_key.0", ["B", KV_HEADS, "C", HEAD_DIM]), ("past_value.0", ["B", KV_HEADS, "C", HEAD_DIM]))]
    inputs.append(helper.make_tensor_value_info("past_lens", TensorProto.INT32, ["B"]))
    if seq == 1:
        inputs.append(helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["B", 1]))
    attrs = AttentionAttrs(HEADS, KV_HEADS, SCALE).as_dict()
    node = helper.make_node(CANONICAL_OP.op_type, ["q", "k", "v", "past_key.0", "past_value.0", "past_lens", "",
                                                   "slopes"], ["out", "present_key.0", "present_value.0"],
                            domain=CANONICAL_OP.domain, **attrs)
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in ("out", "present_key.0", "present_value.0")]
    graph = helper.make_graph([node], "alibi", inputs, outputs, [onnx.numpy_helper.from_array(slopes, "slopes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24),
                                                    helper.make_opsetid(CANONICAL_OP.domain, CANONICAL_OP.version)])
    model.ir_version = 10
    return ir.from_proto(model)


def run_lowered(target: str, seq: int | None, feeds: dict, slopes: np.ndarray) -> list[np.ndarray]:
    from kvforge.exporter.lowering import lower
    from kvforge.exporter.targets import export_target

    model = lower(canonical_model(seq, slopes), export_target(target))
    proto = ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {value.name for value in session.get_inputs()}
    return session.run(None, {name: value for name, value in feeds.items() if name in names})


# (batch, new tokens, past_lens): a first prompt, a chunk after cached rows, a decode step of rows at different lengths.
CALLS = {"prefill": (2, 5, [0, 0]), "chunk": (1, 4, [6]), "decode": (3, 1, [2, 9, 14])}


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("call", list(CALLS))
def test_lowered_alibi_equals_numpy_with_six_heads(target: str, call: str) -> None:
    batch, seq, past = CALLS[call]
    rng = np.random.default_rng(len(call))
    q = rng.standard_normal((batch, seq, HEADS * HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((batch, seq, KV_HEADS * HEAD_DIM), dtype=np.float32) for _ in range(2))
    past_key, past_value = (rng.standard_normal((batch, KV_HEADS, CAPACITY, HEAD_DIM), dtype=np.float32)
                            for _ in range(2))
    past_lens = np.array(past, np.int32)
    slopes = bloom_slopes(HEADS)
    assert len(set(slopes.tolist())) == HEADS and slopes[4] == 0.5  # the interleaved second series
    feeds = {"q": q, "k": k, "v": v, "past_key.0": past_key, "past_value.0": past_value, "past_lens": past_lens,
             INPUT_IDS: np.zeros((batch, 1), np.int64)}
    out, present_key, present_value = run_lowered(target, 1 if seq == 1 else None, feeds, slopes)
    expected, keys, values = alibi_attention(q, k, v, past_key, past_value, past_lens, slopes)
    for b, start in enumerate(past):  # rows past the written ones are the runtime's business; compare the rest
        end = start + seq
        np.testing.assert_array_equal(present_key[b, :, :end], keys[b, :, :end])
        np.testing.assert_array_equal(present_value[b, :, :end], values[b, :, :end])
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
    # ... and the bias matters here: without it the same call is far off.
    without, _, _ = alibi_attention(q, k, v, past_key, past_value, past_lens, np.zeros_like(slopes))
    assert np.abs(without - expected).max() > 1e-2


def test_the_torch_reference_adds_the_same_alibi() -> None:
    torch = pytest.importorskip("torch")
    from kvforge.plugins.reference import kv_cache_attention

    batch, seq, past = CALLS["chunk"]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((batch, seq, HEADS * HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((batch, seq, KV_HEADS * HEAD_DIM), dtype=np.float32) for _ in range(2))
    cache = [rng.standard_normal((batch, KV_HEADS, CAPACITY, HEAD_DIM), dtype=np.float32) for _ in range(2)]
    slopes = bloom_slopes(HEADS)
    out, _, _ = kv_cache_attention(*(torch.from_numpy(x) for x in (q, k, v, *cache, np.array(past, np.int32))),
                                   AttentionAttrs(HEADS, KV_HEADS, SCALE), None, torch.from_numpy(slopes))
    expected, _, _ = alibi_attention(q, k, v, *cache, np.array(past), slopes)
    np.testing.assert_allclose(out.numpy(), expected, atol=2e-5, rtol=0)


def test_the_trt_target_refuses_alibi_in_one_line() -> None:
    from kvforge.core.errors import UnsupportedModelError
    from kvforge.exporter.lowering import lower
    from kvforge.exporter.targets import export_target

    with pytest.raises(UnsupportedModelError, match=r"^the model's attention uses ALiBi position biases, which "
                                                    r"kvforge's TensorRT kernel does not implement; use --target ort "
                                                    r"or --target onnx$"):
        lower(canonical_model(None, bloom_slopes(HEADS)), export_target("trt"))
