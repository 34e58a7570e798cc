"""What a pre-quantised checkpoint's tensors must be before kvforge carries them (exporter/quantization/prequantized.py):
each part's dtype, rank and shape against the others and the config's bits and group size, scales finite,
an act-order g_idx naming real groups. A corrupt tensor would otherwise be carried as it is (a NaN scale, a
float qweight read as integers) and the export would answer garbage; each is refused in one line naming
the tensor and what is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvforge.core.errors import InputError

WORDS = "int32"  # every format packs its integers in int32 words
CONFIG_HINT = "or config.json's quantization_config (bits {bits}, group_size {group}) does not describe it"


def refuse(name: str, what: str, hint: str = "") -> InputError:
    return InputError(f"{name} {what}: the checkpoint is corrupt{hint}; export a sound copy (download or quantise "
                      "it again)")


def checked(name: str, tensor: Any, role: str) -> np.ndarray:
    """A torch tensor read from the checkpoint as numpy, after checking its dtype for `role`: "words" (int32
    packed integers), "index" (integers: g_idx, weight_shape), "scales" (floating, every value finite), "float"
    (a float weight carried as it is: floating, finite), "any" (another tensor: as it is, floats widened)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if role in ("words", "index"):
        if tensor.is_floating_point() or tensor.is_complex() or dtype == "bool" or role == "words" and dtype != WORDS:
            want = "int32 words of packed integers" if role == "words" else "integers"
            raise refuse(name, f"is {dtype}; it must hold {want}")
        return tensor.numpy()
    if role == "any":
        return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
    if not tensor.is_floating_point():
        raise refuse(name, f"is {dtype}; a {'scale' if role == 'scales' else 'float weight'} must be floating point")
    values = tensor.float().numpy()
    bad = ~np.isfinite(values)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), values.shape) if values.ndim else ()
        raise refuse(name, f"holds {int(bad.sum())} non-finite value(s) ({values[first]} at {list(map(int, first))})")
    return values


def shape_is(name: str, array: np.ndarray, shape: tuple[int, ...], why: str, bits: int, group: int) -> None:
    """Refuse `array` unless it has `shape` (`why` says where that shape comes from)."""
    if tuple(array.shape) != tuple(shape):
        raise refuse(name, f"has shape {list(array.shape)}, not {list(shape)} ({why})",
                     ", " + CONFIG_HINT.format(bits=bits, group=group))


def matrix(name: str, array: np.ndarray) -> tuple[int, int]:
    if array.ndim != 2 or 0 in array.shape:
        raise refuse(name, f"has shape {list(array.shape)}; it must be a non-empty matrix")
    return int(array.shape[0]), int(array.shape[1])


def inputs_fit(name: str, cols: int, bits: int, group: int) -> int:
    """The number of groups of `cols` input features; refused unless groups of `group` tile them (MatMulNBits'
    blocks)."""
    if cols % group:
        raise refuse(name, f"packs {cols} input features, which groups of {group} do not divide",
                     ", " + CONFIG_HINT.format(bits=bits, group=group))
    return cols // group


def g_idx_fits(name: str, g_idx: np.ndarray, cols: int, groups: int, bits: int, group: int) -> np.ndarray:
    """An act-order g_idx: one group number per input feature, each below `groups`."""
    shape_is(name, g_idx, (cols,), "one group number per input feature", bits, group)
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise refuse(name, f"names groups {int(g_idx.min())}..{int(g_idx.max())}; the scales hold {groups}")
    return g_idx
