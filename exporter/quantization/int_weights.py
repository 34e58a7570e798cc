"""A linear layer's weight already held as integers: what a pre-quantised checkpoint (GPTQ, AWQ,
compressed-tensors, AutoRound) or a GGUF block type (Q4_0, Q4_1, Q4_K, Q8_0) stores, in one neutral form.

The form is the one ONNX Runtime's MatMulNBits reads: rows are output features, blocks of `block_size`
consecutive input features share one scale and one zero point, and a value is `scale * (q - zero_point)`.
The zero points are integers, or floats where the format's block minimum is no whole number of steps
(a GGUF Q4_1 block, `d * q + m`: zero point `-m / d`); the exporter runs those beside the integer kernel
(exporter/quantization/float_offsets.py). A checkpoint whose groups are not consecutive (GPTQ's act-order `g_idx`)
is held with its input features reordered so that they are, and `order` says how: the graph gathers the
activations in that order before the product. The exporter packs these as they are
(exporter/quantization/exact_blocks.py): nothing is dequantised and rounded again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WeightSpec:
    """What an exporter needs of an integer weight before its values are read."""

    bits: int
    block_size: int
    shape: tuple[int, int]  # [N, K]
    symmetric: bool
    order: tuple[int, ...] | None
    float_zero_points: bool = False


@dataclass
class IntWeight:
    """One weight matrix [N outputs, K inputs] as integers in [0, 2**bits), per-block scales and zero points."""

    bits: int
    block_size: int
    values: np.ndarray  # uint8 [N, K], the input features in `order`
    scales: np.ndarray  # float [N, K // block_size]
    zero_points: np.ndarray | None = None  # uint8 or float32 [N, K // block_size]; None: 2**(bits - 1) everywhere
    order: np.ndarray | None = None  # int64 [K]: values[:, i] is input feature order[i]; None: natural order

    def __post_init__(self) -> None:
        rows, cols = self.values.shape
        if cols % self.block_size or self.scales.shape != (rows, cols // self.block_size):
            raise ValueError(f"scales of shape {self.scales.shape} do not fit {rows} x {cols} values in blocks of "
                             f"{self.block_size}")
        if self.zero_points is not None and self.zero_points.shape != self.scales.shape:
            raise ValueError(f"zero points of shape {self.zero_points.shape}, scales {self.scales.shape}")
        if self.zero_points is not None and self.zero_points.dtype not in (np.uint8, np.float32):
            raise ValueError(f"zero points must be uint8 or float32, not {self.zero_points.dtype}")
        if self.values.dtype != np.uint8 or int(self.values.max(initial=0)) >= 1 << self.bits:
            raise ValueError(f"values must be uint8 below {1 << self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def zero_point_array(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, 1 << (self.bits - 1), np.uint8)

    def symmetric(self) -> bool:
        """Every zero point is the default 2**(bits - 1): MatMulNBits then needs none (its fastest CPU path)."""
        return self.zero_points is None or bool((self.zero_points == 1 << (self.bits - 1)).all())

    def float_zero_points(self) -> bool:
        return self.zero_points is not None and self.zero_points.dtype == np.float32

    def dequantized(self) -> np.ndarray:
        """The float32 weight [N, K] in the natural input order: scale * (q - zero point), in fp32."""
        rows, cols = self.values.shape
        blocks = cols // self.block_size
        q = self.values.reshape(rows, blocks, self.block_size).astype(np.float32)
        zero = self.zero_point_array().astype(np.float32)[:, :, None]
        dense = ((q - zero) * self.scales.astype(np.float32)[:, :, None]).reshape(rows, cols)
        if self.order is None:
            return dense
        natural = np.empty_like(dense)
        natural[:, self.order] = dense
        return natural


def grouped_order(g_idx: np.ndarray, group_size: int) -> np.ndarray | None:
    """The input order that makes GPTQ's groups consecutive (None: they already are), checking that each
    group holds exactly `group_size` features (what MatMulNBits' blocks need)."""
    g_idx = np.asarray(g_idx, np.int64)
    if (g_idx == np.arange(g_idx.size) // group_size).all():
        return None
    counts = np.bincount(g_idx, minlength=g_idx.size // group_size)
    if g_idx.min() < 0 or (counts != group_size).any():
        raise ValueError(f"its g_idx does not give every group {group_size} input features")
    return np.argsort(g_idx, kind="stable")
