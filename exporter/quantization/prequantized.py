"""Pre-quantised Hugging Face checkpoints read as integer weights (kvforge.exporter.quantization.int_weights): GPTQ,
AWQ, compressed-tensors (llm-compressor's pack-quantized int weights) and AutoRound.

Each format's documented layout, per linear layer with prefix P:
- GPTQ (`quant_method: gptq`, and AutoRound's `auto_round:auto_gptq` packing): P.qweight int32
  [K * bits / 32, N], input features packed along the rows, the first in the low bits; P.qzeros int32
  [groups, N * bits / 32] packed along the columns, holding zero - 1 (the original GPTQ format; `gptq_v2`
  holds the zero itself); P.scales [groups, N]; P.g_idx [K] (the group of each input, act-order).
- AWQ (`quant_method: awq`, version gemm, and `auto_round:auto_awq`): P.qweight int32 [K, N / 8] and
  P.qzeros int32 [groups, N / 8], eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7; P.scales.
- compressed-tensors `pack-quantized`: P.weight_packed int32 [N, K * bits / 32] packed along the inputs,
  each value stored plus 2**(bits - 1); P.weight_scale [N, groups]; P.weight_zero_point (asymmetric)
  int32 packed along the outputs, offset alike; P.weight_g_idx (act-order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.exporter.quantization.int_weights import IntWeight, WeightSpec, grouped_order
from kvforge.exporter.quantization.prequantized_checks import (
    checked,
    g_idx_fits,
    inputs_fit,
    matrix,
    refuse,
    shape_is,
)
from kvforge.models.checkpoint_names import PREQUANTIZED_MARKER

MARKER = PREQUANTIZED_MARKER
AWQ_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # output j of a word sits in nibble AWQ_ORDER[j]
TAKEN = "kvforge imports gptq, awq (gemm), compressed-tensors (pack-quantized) and auto-round checkpoints"
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Layout:
    """How one checkpoint stores its integers."""

    kind: str  # "gptq", "awq", "compressed-tensors", "auto-round"
    packing: str  # "gptq", "awq", "pack-quantized"
    bits: int
    group_size: int
    zero_minus_one: bool = False  # GPTQ's original format stores zero - 1

    def describe(self) -> str:
        return f"{self.kind} ({self.bits}-bit, groups of {self.group_size}, {self.packing} packing)"

    @property
    def article(self) -> str:
        """"a" or "an" before the kind's name in a sentence ("an auto-round checkpoint", "a gptq checkpoint")."""
        return "an" if self.kind[:1] in "aeiou" else "a"


def read_quantization_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return quant if isinstance(quant, dict) else None


def layout_of(quant: dict[str, Any], where: str) -> Layout:
    """The layout a quantization_config describes, or an InputError in one line naming what is not taken."""
    method = str(quant.get("quant_method", "")).lower()
    if method == "gptq":
        v2 = str(quant.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return _checked(Layout("gptq", "gptq", int(quant.get("bits", 0)), int(quant.get("group_size", 0)), not v2), where)
    if method == "awq":
        if str(quant.get("version", "gemm")).lower() != "gemm" or quant.get("zero_point") is False:
            raise InputError(f"{where} is an AWQ checkpoint of version {quant.get('version')!r} (zero_point "
                             f"{quant.get('zero_point')!r}): {TAKEN}; AWQ as version gemm with zero points")
        return _checked(Layout("awq", "awq", int(quant.get("w_bit", quant.get("bits", 0))),
                               int(quant.get("q_group_size", quant.get("group_size", 0)))), where)
    if method in ("auto-round", "intel/auto-round", "auto_round"):
        packing = str(quant.get("packing_format", "auto_round:auto_gptq")).lower()
        if packing not in ("auto_round:auto_gptq", "auto_round:auto_awq") or quant.get("extra_config"):
            raise InputError(f"{where} is an AutoRound checkpoint packed as {packing!r}"
                             f"{' with per-layer settings' if quant.get('extra_config') else ''}: {TAKEN}; "
                             "AutoRound as auto_round:auto_gptq or auto_round:auto_awq, one setting for every layer")
        kind = "awq" if packing.endswith("awq") else "gptq"
        return _checked(Layout("auto-round", kind, int(quant.get("bits", 0)), int(quant.get("group_size", 0)),
                               kind == "gptq"), where)
    if method == "compressed-tensors":
        return _checked(_compressed_tensors(quant, where), where)
    raise InputError(f"{where} is quantised with {method or 'an unnamed method'!s}: {TAKEN}; export the unquantised "
                     "model instead")


def _compressed_tensors(quant: dict[str, Any], where: str) -> Layout:
    groups = list((quant.get("config_groups") or {}).values())
    formats = {str(g.get("format") or quant.get("format")) for g in groups}
    weights = [g.get("weights") or {} for g in groups]
    if len(groups) != 1 or formats != {"pack-quantized"} or groups[0].get("input_activations"):
        raise InputError(f"{where} is a compressed-tensors checkpoint in format {', '.join(sorted(formats))} with "
                         f"{len(groups)} group(s){' and quantised activations' if groups and groups[0].get('input_activations') else ''}: "
                         f"{TAKEN}; compressed-tensors as one pack-quantized group of int weights (W4A16, W8A16)")
    spec = weights[0]
    if spec.get("type", "int") != "int" or spec.get("strategy") != "group":
        raise InputError(f"{where} is a compressed-tensors checkpoint of {spec.get('type')} weights, strategy "
                         f"{spec.get('strategy')!r}: {TAKEN}; int weights in groups (strategy 'group')")
    return Layout("compressed-tensors", "pack-quantized", int(spec.get("num_bits", 0)), int(spec.get("group_size") or 0))


def _checked(layout: Layout, where: str) -> Layout:
    if layout.bits not in (4, 8) or layout.packing == "awq" and layout.bits != 4:
        raise InputError(f"{where} is {layout.article} {layout.kind} checkpoint of {layout.bits}-bit weights: kvforge imports 4-bit "
                         "(and GPTQ/compressed-tensors 8-bit) weights")
    if layout.group_size not in BLOCK_SIZES:
        raise InputError(f"{where} is {layout.article} {layout.kind} checkpoint with groups of {layout.group_size}: MatMulNBits takes "
                         f"blocks of {', '.join(map(str, BLOCK_SIZES))} (per-channel scales are not taken)")
    return layout


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> uint8 values along `axis`, the first value of a word in its low bits."""
    words = np.ascontiguousarray(np.moveaxis(words.astype(np.int32), axis, -1)).view(np.uint32)
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)
    return np.moveaxis(values, -1, axis)


class PrequantizedWeights:
    """The integer weights of a pre-quantised checkpoint, by the parameter name of the weight they replace."""

    def __init__(self, model_dir: Path, layout: Layout) -> None:
        from safetensors import safe_open

        self.model_dir, self.layout, self.kind = Path(model_dir), layout, layout.kind
        self.rounds_the_rest = False  # its float weights (lm_head, embedding) stay float: the export equals it
        self.files: dict[str, Path] = {}
        self._specs: dict[str, WeightSpec] = {}
        for file in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(file), "np") as handle:
                self.files.update({name: file for name in handle.keys()})  # noqa: SIM118 (a handle, not a dict)
        suffix = ".weight_packed" if layout.packing == "pack-quantized" else ".qweight"
        self.prefixes = sorted(name[: -len(suffix)] for name in self.files if name.endswith(suffix))
        if not self.prefixes:
            raise InputError(f"{model_dir} says it is {layout.article} {layout.kind} checkpoint but holds no *{suffix} tensors")

    def weight_names(self) -> list[str]:
        return [f"{prefix}.weight" for prefix in self.prefixes]

    def tensor(self, name: str, role: str = "float") -> np.ndarray:
        """A tensor as numpy, its dtype (and a float's finiteness) checked for `role` (exporter/quantization/prequantized_checks.py)."""
        from safetensors import safe_open

        if name not in self.files:  # a quantised layer's part is missing (its qweight is there)
            raise refuse(name, f"is missing (a {self.layout.describe()} layer stores its weight in several tensors)")
        with safe_open(str(self.files[name]), "pt") as handle:  # "pt": bf16 scales have no numpy dtype
            return checked(name, handle.get_tensor(name), role)

    def has(self, name: str) -> bool:
        return name in self.files

    def spec(self, name: str) -> WeightSpec | None:
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix not in self.prefixes:
            return None
        if name not in self._specs:  # read once (the weight itself: one reader per layout), asked for again
            weight = self.load(name)
            order = None if weight.order is None else tuple(int(i) for i in weight.order)
            self._specs[name] = WeightSpec(weight.bits, weight.block_size, weight.shape, weight.symmetric(), order)
        return self._specs[name]

    def load(self, name: str) -> IntWeight:
        prefix = name.removesuffix(".weight")
        read = {"pack-quantized": self._compressed, "awq": self._awq, "gptq": self._gptq}[self.layout.packing]
        values, scales, zeros, g_idx = read(prefix)
        return _as_int_weight(prefix, self.layout, np.ascontiguousarray(values), scales, zeros, g_idx)

    def _gptq(self, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        bits, group = self.layout.bits, self.layout.group_size
        qweight = self.tensor(f"{prefix}.qweight", "words")
        words, rows = matrix(f"{prefix}.qweight", qweight)
        cols = words * 32 // bits
        groups = inputs_fit(f"{prefix}.qweight", cols, bits, group)
        why = f"{groups} group(s) of the {cols} input features qweight {list(qweight.shape)} packs at {bits} bits"
        scales = self.tensor(f"{prefix}.scales", "scales")
        shape_is(f"{prefix}.scales", scales, (groups, rows), f"{why}, by {rows} outputs", bits, group)
        qzeros = self.tensor(f"{prefix}.qzeros", "words")
        shape_is(f"{prefix}.qzeros", qzeros, (groups, rows * bits // 32), f"{why}, {rows} outputs at {bits} bits a word",
                 bits, group)
        values = _unpack(qweight, bits, 0).T
        zeros = _unpack(qzeros, bits, 1).T.astype(np.int16)
        if self.layout.zero_minus_one:
            zeros = zeros + 1
        if zeros.max() >= 1 << bits:
            raise InputError(f"{prefix}.qzeros: a GPTQ zero point of {int(zeros.max())} does not fit {bits} bits")
        g_idx = None
        if self.has(f"{prefix}.g_idx"):
            g_idx = g_idx_fits(f"{prefix}.g_idx", self.tensor(f"{prefix}.g_idx", "index"), cols, groups, bits, group)
        return values, scales.T, zeros.astype(np.uint8), g_idx

    def _awq(self, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        bits, group = self.layout.bits, self.layout.group_size
        qweight = self.tensor(f"{prefix}.qweight", "words")
        cols, words = matrix(f"{prefix}.qweight", qweight)
        rows = words * 8  # AWQ packs eight 4-bit outputs a word
        groups = inputs_fit(f"{prefix}.qweight", cols, bits, group)
        why = f"{groups} group(s) of the {cols} input features of qweight {list(qweight.shape)}"
        scales = self.tensor(f"{prefix}.scales", "scales")
        shape_is(f"{prefix}.scales", scales, (groups, rows), f"{why}, by its {rows} outputs", bits, group)
        qzeros = self.tensor(f"{prefix}.qzeros", "words")
        shape_is(f"{prefix}.qzeros", qzeros, (groups, words), f"{why}, eight outputs a word", bits, group)
        columns = np.arange(rows) // 8 * 8 + AWQ_ORDER[np.arange(rows) % 8]
        values = _unpack(qweight, 4, 1)[:, columns].T
        zeros = _unpack(qzeros, 4, 1)[:, columns].T
        return values, scales.T, zeros, None

    def _compressed(self, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        bits, group = self.layout.bits, self.layout.group_size
        shape = self.tensor(f"{prefix}.weight_shape", "index")
        if shape.shape != (2,) or (shape <= 0).any():
            raise refuse(f"{prefix}.weight_shape", f"is {shape.tolist()}; it must be the two sizes of the weight")
        rows, cols = (int(d) for d in shape)
        groups = inputs_fit(f"{prefix}.weight_shape", cols, bits, group)
        why = f"a {rows} x {cols} weight (weight_shape) at {bits} bits in groups of {group}"
        packed = self.tensor(f"{prefix}.weight_packed", "words")
        shape_is(f"{prefix}.weight_packed", packed, (rows, -(-cols * bits // 32)), why, bits, group)
        scales = self.tensor(f"{prefix}.weight_scale", "scales")
        shape_is(f"{prefix}.weight_scale", scales, (rows, groups), why, bits, group)
        zeros = None
        if self.has(f"{prefix}.weight_zero_point"):
            packed_zeros = self.tensor(f"{prefix}.weight_zero_point", "words")
            shape_is(f"{prefix}.weight_zero_point", packed_zeros, (-(-rows * bits // 32), groups), why, bits, group)
            zeros = _unpack(packed_zeros, bits, 0)[:rows]
        g_idx = None
        if self.has(f"{prefix}.weight_g_idx"):
            g_idx = g_idx_fits(f"{prefix}.weight_g_idx", self.tensor(f"{prefix}.weight_g_idx", "index"), cols, groups,
                               bits, group)
        return _unpack(packed, bits, 1)[:, :cols], scales, zeros, g_idx


def _as_int_weight(prefix: str, layout: Layout, values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                   g_idx: np.ndarray | None) -> IntWeight:
    """Values [N, K] and per-group scales/zeros [N, groups] as blocks in MatMulNBits' order."""
    order = None
    if g_idx is not None:
        try:
            order = grouped_order(g_idx, layout.group_size)
        except ValueError as err:
            raise InputError(f"{prefix}: {err}") from None
    if order is not None:
        values = np.ascontiguousarray(values[:, order])
    return IntWeight(layout.bits, layout.group_size, values.astype(np.uint8),
                     np.ascontiguousarray(scales, dtype=np.float32), zeros, order)
