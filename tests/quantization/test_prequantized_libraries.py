"""Checkpoints made or packed by the quantisation libraries themselves (issue 44, 2), imported bit for bit:
- AutoRound (the real library, a few tuning steps on the CPU) in both its packings: symmetric weights as
  auto_round:auto_gptq, asymmetric as auto_round:auto_awq;
- compressed-tensors' pack-quantized W4A16 (symmetric and asymmetric, and act-order groups), packed with the
  library's own pack_to_int32.
Each export, with fp32 products, gives the logits of the model holding the library's own dequantised
weights (AutoRound's AWQ dequantiser, compressed-tensors' unpack and dequantize), and its greedy tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.xdist_group("prequantized")


def _export_equals(folder, reference_weights, base, tmp_path, kind):
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.export import export_model
    from kvforge.runtime import GenerationRequest, Generator

    manifest = export_model(folder, tmp_path / "out", accuracy_level=1)
    record = manifest["quantization"]["integer_weights"]
    assert record["source"] == kind and record["rounded"] == [] and record["carried_over"] > 0
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    state = reference.state_dict()
    assert set(reference_weights) <= set(state)
    state.update({name: torch.as_tensor(w, dtype=torch.float32) for name, w in reference_weights.items()})
    reference.load_state_dict(state)
    ids = [11, 23, 5, 77, 140, 9, 31]
    result = Generator(tmp_path / "out").generate(GenerationRequest([ids], 10, ignore_eos=True, keep_logits=True))
    tokens = result.tokens[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].numpy()
    assert np.abs(np.stack([s[0] for s in result.logits]) - expected).max() < 1e-3
    assert tokens == expected.argmax(-1).tolist()
    from kvforge.tools.parity import run_parity

    report = run_parity(folder, tmp_path / "out", new_tokens=16)  # the checkpoint itself, through its twin
    assert report.passed, report.failure_reason()


@pytest.mark.parametrize("symmetric", [True, False], ids=["auto_gptq", "auto_awq"])
def test_an_autoround_checkpoint_made_by_autoround_exports_its_integers(symmetric, hf_folder, tmp_path):
    pytest.importorskip("auto_round")
    import torch
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = hf_folder("llama-tiny")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = ["the quick brown fox jumps over the lazy dog " * 8] * 4
    quantizer = AutoRound(model, tokenizer, scheme="W4A16", bits=4, group_size=32, sym=symmetric, dataset=texts,
                          iters=2, nsamples=4, seqlen=32, batch_size=2, device_map="cpu", enable_torch_compile=False)
    quantizer.quantize_and_save(str(tmp_path / "ar"), format="auto_round")
    folder = next(p.parent for p in (tmp_path / "ar").rglob("config.json"))
    packing = json.loads((folder / "config.json").read_text())["quantization_config"]["packing_format"]
    assert packing == ("auto_round:auto_gptq" if symmetric else "auto_round:auto_awq")
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    weights = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        qweight, qzeros, scales = (tensors[f"{prefix}.{part}"] for part in ("qweight", "qzeros", "scales"))
        if symmetric:  # GPTQ's documented layout: inputs packed along rows, zero - 1 stored
            shifts = torch.arange(0, 32, 4, dtype=torch.int32)
            q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
            z = ((qzeros[:, :, None] >> shifts[None, None, :]) & 15).reshape(qzeros.shape[0], -1) + 1
            groups = torch.arange(q.shape[0]) // 32
            weights[f"{prefix}.weight"] = ((q - z[groups]).float() * scales.float()[groups]).T
        else:  # AutoRound's own AWQ dequantiser, in fp32
            from auto_round.export.export_to_awq.utils import dequantize_gemm

            weights[f"{prefix}.weight"] = dequantize_gemm(qweight, qzeros, scales.float(), 4, 32).T
    _export_equals(folder, weights, base, tmp_path, "auto-round")


@pytest.mark.parametrize("symmetric, act_order", [(True, False), (False, False), (True, True)],
                         ids=["sym", "asym", "act-order"])
def test_a_compressed_tensors_checkpoint_exports_its_integers(symmetric, act_order, hf_folder, tmp_path):
    pytest.importorskip("compressed_tensors")
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from safetensors.torch import load_file, save_file

    base = hf_folder("llama-tiny")
    folder = tmp_path / "ct"
    shutil.copytree(base, folder)
    (folder / "model.safetensors").unlink()
    tensors = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    out, weights = {}, {}
    for name, value in tensors.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith("proj.weight"):
            out[name] = value
            continue
        rows, cols = value.shape
        q = torch.randint(-8, 8, (rows, cols), generator=generator, dtype=torch.int8)
        scale = (torch.rand(rows, cols // 32, generator=generator) * 0.02 + 0.001).to(torch.bfloat16)
        zero = None if symmetric else torch.randint(-3, 4, (rows, cols // 32), generator=generator, dtype=torch.int8)
        g_idx = torch.randperm(cols, generator=generator) // 32 if act_order else torch.arange(cols) // 32
        out[f"{prefix}.weight_packed"] = pack_to_int32(q, 4)
        out[f"{prefix}.weight_scale"] = scale
        out[f"{prefix}.weight_shape"] = torch.tensor([rows, cols])
        if zero is not None:
            out[f"{prefix}.weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
        if act_order:
            out[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
        # The library's own reading of what it packed: unpack, then x = (q - zero) * scale per group
        unpacked = unpack_from_int32(out[f"{prefix}.weight_packed"], 4, torch.Size([rows, cols])).float()
        zeros = 0 if zero is None else unpack_from_int32(out[f"{prefix}.weight_zero_point"], 4,
                                                           torch.Size([rows, cols // 32]), packed_dim=0).float()[:, g_idx]
        weights[name] = (unpacked - zeros) * scale.float()[:, g_idx]
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 32,
            "actorder": "group" if act_order else None}}}}
    (folder / "config.json").write_text(json.dumps(config))
    _export_equals(folder, weights, base, tmp_path, "compressed-tensors")
