"""A GGUF's Q4_0 and Q8_0 blocks as integer weights (kvforge.models.int_weights), carried into MatMulNBits
as they are instead of dequantised and rounded again.

ggml's layouts (ggml-common.h): a Q4_0 block is 32 weights in 18 bytes, an fp16 scale d then 16 bytes
whose low nibbles are weights 0-15 and high nibbles weights 16-31, each worth d * (q - 8); a Q8_0 block is
an fp16 d then 32 int8 weights, each worth d * q. Both are MatMulNBits' symmetric blocks of 32 (zero point
8, resp. 128 once the int8 is offset to uint8), so the carried weight is exactly the GGUF's. The row order
is the one the Hugging Face conversion gives (Llama's q/k rows un-permuted by transformers' own processor).
Other block types (Q4_1 and the k-quants: float minimums, 16-weight sub-blocks) keep the dequantise path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.models.int_weights import IntWeight, WeightSpec

CARRIED = {"Q4_0": 4, "Q8_0": 8}
BLOCK = 32


def q4_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 bytes [rows, cols / 32 * 18] -> values uint8 [rows, cols] in 0..15 and scales float32 [rows, cols / 32]."""
    blocks = raw.reshape(rows, cols // BLOCK, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # weights 0-15, then 16-31
    return values.reshape(rows, cols).astype(np.uint8), scales


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes [rows, cols / 32 * 34] -> values uint8 [rows, cols] (int8 + 128) and scales float32."""
    blocks = raw.reshape(rows, cols // BLOCK, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return values.reshape(rows, cols), scales


class GGUFIntWeights:
    """The Q4_0 / Q8_0 matrices of a GGUF by the Hugging Face parameter name its conversion gives them."""

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
        return WeightSpec(CARRIED[entry.tensor.tensor_type.name], BLOCK, tuple(entry.shape), True, None)

    def load(self, name: str) -> IntWeight:
        entry = self.entries[name]
        kind = entry.tensor.tensor_type.name
        rows, cols = entry.shape
        values, scales = (q4_0_blocks if kind == "Q4_0" else q8_0_blocks)(np.asarray(entry.tensor.data), rows, cols)
        # The conversion's own processing (Llama's q/k row order) on the integers and their scales alike:
        # it moves whole rows, which both keep.
        values = self._processed(entry, values)
        scales = self._processed(entry, scales)
        return IntWeight(CARRIED[kind], BLOCK, np.ascontiguousarray(values), np.ascontiguousarray(scales))

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
