"""Pre-quantised checkpoints (GPTQ with and without act-order, GPTQ v2, AWQ) carried into MatMulNBits bit
for bit (issue 44, 2): the export's blocks are the checkpoint's integers, and with fp32 products
(--accuracy-level 1) its logits equal the checkpoint's dequantised model's, HF eager, within fp32's
tolerance; the greedy tokens are the same."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from prequantized_checkpoints import make, reference_weights  # noqa: E402

pytestmark = pytest.mark.xdist_group("prequantized")

CASES = {
    "gptq-asym": dict(fmt="gptq"),
    "gptq-act-order": dict(fmt="gptq", act_order=True),
    "gptq-sym-v2": dict(fmt="gptq_v2", symmetric=True),
    "gptq-int8": dict(fmt="gptq", bits=8, symmetric=True),
    "awq": dict(fmt="awq"),
}


def _reference_model(base, truth):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    state = model.state_dict()
    for name, weight in reference_weights(truth).items():
        state[name] = torch.from_numpy(weight)
    model.load_state_dict(state)
    return model


def _blocks(export, bits):
    """Every MatMulNBits of the export's prefill graph: name -> (B, scales, zero points or None)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(export / "prefill.onnx"), load_external_data=True)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and dict((a.name, a.i) for a in node.attribute)["bits"] == bits:
            inputs = list(node.input) + [""] * 3
            found[node.input[1]] = (values[inputs[1]], values[inputs[2]], values.get(inputs[3]))
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prequantized_checkpoint_exports_its_integers_as_they_are(case, hf_folder, tmp_path):
    import torch

    from kvforge.exporter.export import export_model
    from kvforge.runtime import GenerationRequest, Generator

    options = CASES[case]
    base = hf_folder("llama-tiny")
    truth = make(tmp_path / case, base, **options)
    said_export: list[str] = []
    manifest = export_model(tmp_path / case, tmp_path / "out", accuracy_level=1, progress=said_export.append)
    record = manifest["quantization"]["integer_weights"]
    # Nothing is rounded, so the progress says the integers are placed, not "quantising ... RTN" (issue 53)
    assert any("integers into ONNX Runtime's MatMulNBits" in line and "as they are" in line for line in said_export)
    assert not any(line.startswith("quantising the weights") for line in said_export), said_export
    assert record["source"] in ("gptq", "awq") and record["rounded"] == [], record
    assert record["carried_over"] == 4 * json.loads((base / "config.json").read_text())["num_hidden_layers"]

    bits = options.get("bits", 4)
    blocks = _blocks(tmp_path / "out", bits)
    # q/k/v joined: the first layer's merged blocks hold q's values then k's then v's, in the blocks' order
    fused = next(v for k, v in blocks.items() if "layers.0.self_attn.q_proj" in k)
    q, zero, _, g_idx = truth["model.layers.0.self_attn.q_proj"]
    order = np.argsort(g_idx, kind="stable")
    packed = fused[0][: q.shape[0]].reshape(q.shape[0], -1)
    unpacked = packed if bits == 8 else np.stack([packed & 15, packed >> 4], -1).reshape(q.shape[0], -1)
    np.testing.assert_array_equal(unpacked, q[:, order])
    if not options.get("symmetric"):
        zeros = fused[2][: q.shape[0]]
        np.testing.assert_array_equal(np.stack([zeros & 15, zeros >> 4], -1).reshape(q.shape[0], -1)[:, :zero.shape[1]],
                                      zero)

    reference = _reference_model(base, truth)
    generator = Generator(tmp_path / "out")
    ids = [5, 17, 42, 99, 7, 3]
    result = generator.generate(GenerationRequest([ids], 12, ignore_eos=True, keep_logits=True))
    tokens = result.tokens[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].numpy()
    ours = np.stack([step[0] for step in result.logits])
    assert np.abs(ours - expected).max() < 1e-3
    assert tokens == expected.argmax(-1).tolist()

    # `kvforge parity` on the checkpoint itself: it compares through the dequantised twin, and passes
    from kvforge.tools.parity import run_parity

    said = []
    report = run_parity(tmp_path / case, tmp_path / "out", new_tokens=16, progress=said.append)
    assert report.passed, report.failure_reason()
    assert report.perplexity["tolerance"] == 0.02 and report.max_abs_err < 1e-3
    assert any("the dequantised twin of" in line for line in said)


def test_a_quantize_option_that_disagrees_with_the_checkpoint_is_refused(hf_folder, tmp_path):
    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model

    make(tmp_path / "gptq", hf_folder("llama-tiny"), "gptq")
    with pytest.raises(InputError, match=r"gptq \(4-bit, groups of 32, gptq packing\) checkpoint.*--quantize int8 does not apply"):
        export_model(tmp_path / "gptq", tmp_path / "out", quantize="int8")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quantization, said", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantised with bitsandbytes: kvforge imports gptq"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "AWQ checkpoint of version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "groups of -1"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {}}}},
     "format float-quantized"),
    ({"quant_method": "auto-round", "packing_format": "auto_round:gptqmodel", "bits": 4, "group_size": 128},
     "AutoRound checkpoint packed as 'auto_round:gptqmodel'"),
])
def test_a_format_kvforge_does_not_take_is_refused_in_one_line(quantization, said, hf_folder, tmp_path):
    import shutil

    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model

    folder = tmp_path / "model"
    shutil.copytree(hf_folder("llama-tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(InputError, match=said) as caught:
        export_model(folder, tmp_path / "out")
    assert "\n" not in str(caught.value)


def test_an_import_with_fp16_activations_keeps_its_integers(hf_folder, tmp_path):
    """--dtype fp16 (ONNX Runtime CUDA's MatMulNBits form, run here on the CPU): the same integers, fp16 scales
    (GPTQ's own dtype), logits within fp16's tolerance of the dequantised model."""
    import torch

    from kvforge.exporter.export import export_model
    from kvforge.runtime import GenerationRequest, Generator

    base = hf_folder("llama-tiny")
    truth = make(tmp_path / "gptq", base, "gptq", act_order=True)
    export_model(tmp_path / "gptq", tmp_path / "out", dtype="fp16", accuracy_level=1)
    blocks = _blocks(tmp_path / "out", 4)
    scales = next(v[1] for k, v in blocks.items() if "layers.0.self_attn.o_proj" in k)
    assert scales.dtype == np.float16
    np.testing.assert_array_equal(scales, truth["model.layers.0.self_attn.o_proj"][2])
    reference = _reference_model(base, truth)
    ids = [5, 17, 42, 99, 7, 3]
    result = Generator(tmp_path / "out").generate(GenerationRequest([ids], 8, ignore_eos=True, keep_logits=True))
    with torch.no_grad():
        expected = reference(torch.tensor([ids + result.tokens[0][:-1]])).logits[0, len(ids) - 1:].numpy()
    assert np.abs(np.stack([s[0] for s in result.logits]).astype(np.float32) - expected).max() < 0.15


def test_calibrating_a_prequantized_checkpoint_is_refused(hf_folder, tmp_path):
    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model

    make(tmp_path / "awq", hf_folder("llama-tiny"), "awq")
    with pytest.raises(InputError, match="carries its integers over as they are, so --quant-method autoround does not apply"):
        export_model(tmp_path / "awq", tmp_path / "out", quant_method="autoround")
