"""A GGUF's Q4_0, Q4_1, Q4_K and Q8_0 blocks as integer weights (kvforge.exporter.quantization.int_weights), carried into MatMulNBits
as they are instead of dequantised and rounded again.

ggml's layouts (ggml-common.h): a Q4_0 block is 32 weights in 18 bytes, an fp16 scale d then 16 bytes
whose low nibbles are weights 0-15 and high nibbles weights 16-31, each worth d * (q - 8); a Q8_0 block is
an fp16 d then 32 int8 weights, each worth d * q. Both are MatMulNBits' symmetric blocks of 32 (zero point
8, resp. 128 once the int8 is offset to uint8), so the carried weight is exactly the GGUF's. A Q4_1 block
is an fp16 d and an fp16 minimum m, then Q4_0's 16 bytes, each weight worth d * q + m: a block with the
float zero point -m / d, which the exporter runs beside the integer kernel (exporter/quantization/float_offsets.py); a
Q4_K super-block is eight such sub-blocks of 32 whose scales and minimums are 6-bit multiples of two fp16s.
The row order is the one the Hugging Face conversion gives (Llama's q/k rows un-permuted by transformers'
own processor). Other block types (5- and 6-bit values: Q5_x, Q6_K; 2-3-bit k-quants) keep the
dequantise path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.exporter.quantization.int_weights import IntWeight, WeightSpec
from kvforge.models.gguf_checks import finite

CARRIED = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}
BLOCK = 32


def q4_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 bytes [rows, cols / 32 * 18] -> values uint8 [rows, cols] in 0..15 and scales float32 [rows, cols / 32]."""
    blocks = raw.reshape(rows, cols // BLOCK, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # weights 0-15, then 16-31
    return values.reshape(rows, cols).astype(np.uint8), scales


def _with_minimums(values: np.ndarray, scales: np.ndarray, minimums: np.ndarray, rows: int,
                   cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks worth scale * q + minimum -> (values, scales, float zero points -minimum / scale), each [rows, ·].
    A block with scale 0 (every weight its minimum) becomes values 0, scale minimum, zero point -1."""
    flat = scales == 0
    values = np.where(flat[..., None], 0, values).astype(np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(flat, -1.0, -minimums / np.where(flat, 1.0, scales)).astype(np.float32)
    return (values.reshape(rows, cols), np.where(flat, minimums, scales).astype(np.float32).reshape(rows, -1),
            zeros.reshape(rows, -1))


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 bytes [rows, cols / 32 * 20] -> values uint8 [rows, cols] in 0..15, scales d and float zero points
    -m / d, float32 [rows, cols / 32]."""
    blocks = raw.reshape(rows, cols // BLOCK, 20)
    halves = blocks[..., :4].copy().view(np.float16).astype(np.float32)
    packed = blocks[..., 4:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # as Q4_0's nibbles
    return _with_minimums(values, halves[..., 0], halves[..., 1], rows, cols)


def q4_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K bytes [rows, cols / 256 * 144] -> values, scales and float zero points per sub-block of 32. A
    super-block is fp16 d and dmin, 12 bytes of 6-bit sub-block scales and minimums (unpacked by gguf-py's own
    Q4_K.get_scale_min), then 128 bytes: each 32 holds two sub-blocks, the low nibbles the first. A weight is
    d * sc * q - dmin * m: exact in fp32 (an fp16 times a 6-bit integer)."""
    from gguf.quants import Q4_K

    supers = raw.reshape(-1, 144)
    d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(supers[:, 4:16])
    packed = supers[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    values = (packed & 0x0F).reshape(rows, cols // BLOCK, BLOCK)
    scales = (d * sc.astype(np.float32)).reshape(rows, -1)
    minimums = -(dmin * m.astype(np.float32)).reshape(rows, -1)
    return _with_minimums(values, scales, minimums, rows, cols)


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes [rows, cols / 32 * 34] -> values uint8 [rows, cols] (int8 + 128) and scales float32."""
    blocks = raw.reshape(rows, cols // BLOCK, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return values.reshape(rows, cols), scales


WITH_MINIMUMS = {"Q4_1": q4_1_blocks, "Q4_K": q4_k_blocks}  # read with float zero points


def _check_size(tensor: Any, name: str, raw: np.ndarray, count: int) -> None:
    from gguf import GGML_QUANT_SIZES

    elements, size = GGML_QUANT_SIZES[tensor.tensor_type]
    if count % elements or raw.nbytes != count // elements * size:
        raise InputError(f"GGUF tensor {tensor.name} ({name}, {tensor.tensor_type.name}) holds {raw.nbytes} bytes where "
                         f"{count} values in blocks of {elements} take {count // elements * size}: the file is corrupt")


class GGUFIntWeights:
    """The Q4_0 / Q4_1 / Q4_K / Q8_0 matrices of a GGUF by the Hugging Face parameter name its conversion gives them."""

    kind = "gguf"
    rounds_the_rest = True

    def __init__(self, gguf_path: Path, entries: dict[str, Any]) -> None:
        self.gguf_path, self.entries = gguf_path, entries  # name -> models.gguf._GGUFTensor

    def types(self) -> dict[str, str]:
        """Each weight matrix's GGUF block type, by parameter name."""
        return {name: entry.tensor.tensor_type.name for name, entry in self.entries.items()}

    def spec(self, name: str) -> Any:
        entry = self.entries.get(name)
        if entry is None or entry.tensor.tensor_type.name not in CARRIED or len(entry.shape) != 2:
            return None
        kind = entry.tensor.tensor_type.name
        minimums = kind in WITH_MINIMUMS
        return WeightSpec(CARRIED[kind], BLOCK, tuple(entry.shape), not minimums, None, minimums)

    def load(self, name: str) -> IntWeight:
        entry = self.entries[name]
        kind = entry.tensor.tensor_type.name
        rows, cols = entry.shape
        raw, zeros = np.asarray(entry.tensor.data), None
        _check_size(entry.tensor, name, raw, rows * cols)
        if kind in WITH_MINIMUMS:
            values, scales, zeros = WITH_MINIMUMS[kind](raw, rows, cols)
        else:
            values, scales = (q4_0_blocks if kind == "Q4_0" else q8_0_blocks)(raw, rows, cols)
        # A NaN or Inf fp16 scale (or minimum) in a block would be carried as it is: the export answers garbage
        finite(entry.tensor.name, f"{kind} block scales", scales)
        if zeros is not None:
            finite(entry.tensor.name, f"{kind} block minimums", zeros)
        # The conversion's own processing (Llama's q/k row order) on the integers, scales and zero points
        # alike: it moves whole rows, which all keep.
        values, scales = self._processed(entry, values), self._processed(entry, scales)
        if zeros is not None:
            zeros = np.ascontiguousarray(self._processed(entry, zeros), np.float32)
        return IntWeight(CARRIED[kind], BLOCK, np.ascontiguousarray(values), np.ascontiguousarray(scales), zeros)

    @staticmethod
    def _processed(entry: Any, array: np.ndarray) -> np.ndarray:
        result = entry.processor.process(weights=array, name=entry.tensor.name, tensor_key_mapping=entry.mapping,
                                         parsed_parameters={})
        return np.asarray(result.weights).reshape(entry.shape[0], -1)


def gguf_int_weights(gguf_path: str | Path, hf_dir: str | Path) -> GGUFIntWeights | None:
    """The GGUF's weight matrices by parameter name (None when its architecture converts through
    transformers' whole-model load, whose tensors are not one parameter each)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvforge.models.gguf import tensor_plan

    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plan = tensor_plan(Path(gguf_path), empty)
    if isinstance(plan, str):
        return None
    entries = {entry.name: entry for entry in plan}
    # A tied lm_head is the embedding's tensor (the conversion writes it once, as the embedding)
    table = empty.get_input_embeddings().weight
    embedding = next((name for name, p in empty.named_parameters() if p is table), None)
    if getattr(config, "tie_word_embeddings", False) and embedding in entries:
        entries.setdefault("lm_head.weight", entries[embedding])
    return GGUFIntWeights(Path(gguf_path), entries)
