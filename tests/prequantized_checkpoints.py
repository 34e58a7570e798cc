"""Tiny pre-quantised checkpoints packed by hand in each format's documented layout (GPTQ, AWQ), from
integers chosen here, so a test knows every value an import must carry: `make(folder, base, fmt)` writes
the checkpoint and returns {layer prefix: (q [N, K] ints, zero [N, groups], scale [N, groups] fp16,
g_idx [K])}; `reference_weights(truth)` gives each layer's dequantised weight from those, in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds output AWQ_PACK_ORDER[i]


def _pack_along(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint values -> int32 words along `axis`, the first value in the low bits (GPTQ's rows, columns)."""
    moved = np.moveaxis(values.astype(np.uint32), axis, -1)
    per = 32 // bits
    grouped = moved.reshape(*moved.shape[:-1], -1, per)
    words = np.zeros(grouped.shape[:-1], np.uint32)
    for i in range(per):
        words |= grouped[..., i] << np.uint32(i * bits)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """[R, C] 4-bit values -> int32 [R, C / 8] in AutoAWQ's interleaved order."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for i, column in enumerate(AWQ_PACK_ORDER):
        words |= values[:, column::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def _layer_ints(rng: np.random.Generator, weight: np.ndarray, bits: int, group: int, symmetric: bool,
                act_order: bool) -> tuple[np.ndarray, ...]:
    """Integers for a weight [N, K]: its groups' scales and zeros from the weight, values rounded."""
    rows, cols = weight.shape
    groups = cols // group
    g_idx = np.arange(cols) // group
    if act_order:
        g_idx = g_idx[rng.permutation(cols)]
    top = (1 << bits) - 1
    scale = np.zeros((rows, groups), np.float16)
    zero = np.zeros((rows, groups), np.int64)
    for g in range(groups):
        block = weight[:, g_idx == g]
        if symmetric:
            scale[:, g] = np.maximum(np.abs(block).max(1), 1e-4) / (top // 2)
            zero[:, g] = 1 << (bits - 1)
        else:
            lo, hi = block.min(1), block.max(1)
            scale[:, g] = np.maximum(hi - lo, 1e-4) / top
            zero[:, g] = np.clip(np.round(-lo / scale[:, g].astype(np.float32)), 1, top - 1)
    s = scale.astype(np.float32)[:, g_idx]
    q = np.clip(np.round(weight / s) + zero[:, g_idx], 0, top).astype(np.int64)
    return q, zero, scale, g_idx


def make(folder: Path, base: Path, fmt: str, bits: int = 4, group: int = 32, symmetric: bool = False,
         act_order: bool = False, seed: int = 0) -> dict[str, tuple[np.ndarray, ...]]:
    """Write `base` (an fp32 HF folder) quantised in `fmt` ("gptq", "gptq_v2", "awq", "compressed-tensors") into
    `folder`."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    tensors = {}
    for file in base.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    truth = {}
    out = {}
    for name, value in sorted(tensors.items()):
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix.rsplit(".", 1)[-1] not in LINEARS:
            out[name] = value
            continue
        q, zero, scale, g_idx = _layer_ints(rng, value.astype(np.float32), bits, group, symmetric, act_order)
        truth[prefix] = (q, zero, scale, g_idx)
        if fmt == "compressed-tensors":  # pack-quantized: [N, K] packed along the inputs, zero points along outputs
            out[f"{prefix}.weight_packed"] = _pack_along(q, bits, 1)
            out[f"{prefix}.weight_scale"] = scale.copy()
            out[f"{prefix}.weight_zero_point"] = _pack_along(zero, bits, 0)
            out[f"{prefix}.weight_shape"] = np.array(q.shape, np.int64)
            continue
        if fmt == "awq":
            out[f"{prefix}.qweight"] = _awq_pack(q.T)
            out[f"{prefix}.qzeros"] = _awq_pack(zero.T)
        else:
            out[f"{prefix}.qweight"] = _pack_along(q.T, bits, 0)
            out[f"{prefix}.qzeros"] = _pack_along(zero.T - (fmt == "gptq"), bits, 1)
            out[f"{prefix}.g_idx"] = g_idx.astype(np.int32)
        out[f"{prefix}.scales"] = scale.T.copy()
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    if fmt == "compressed-tensors":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}}}}
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm",
                                         "zero_point": True}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric,
                                         "desc_act": act_order, "checkpoint_format": fmt}
    (folder / "config.json").write_text(json.dumps(config))
    for file in base.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json" and file.is_file():
            shutil.copy2(file, folder / file.name)
    return truth


def reference_weights(truth: dict[str, tuple[np.ndarray, ...]]) -> dict[str, np.ndarray]:
    """Each layer's weight [N, K] as its integers stand for it: scale * (q - zero), in fp32."""
    weights = {}
    for prefix, (q, zero, scale, g_idx) in truth.items():
        weights[f"{prefix}.weight"] = (scale.astype(np.float32)[:, g_idx] * (q - zero[:, g_idx])).astype(np.float32)
    return weights
