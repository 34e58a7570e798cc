"""torchvision's resize of a uint8 image with BICUBIC (what transformers' torchvision-backend image processors and
every video processor run) made with numpy: torch's native uint8 antialiased bicubic on the CPU.

torch computes Keys' cubic weights (a=-0.5, Pillow's) in float64 over a support scaled with the downscale factor,
normalises them per output pixel, quantises them to int16 at the largest precision that keeps the largest weight
under 2**15, and resamples the width then the height (a pass whose size is unchanged is skipped) with integer
sums, adding half an LSB, shifting and clamping to 0..255 after each pass. Integer arithmetic, so equal to the byte.
"""

from __future__ import annotations

import numpy as np


def _cubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first source index [out], int16 weights [out, taps], precision bits) of one axis."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(np.ceil(support)) * 2 + 1
    centers = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    starts = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    sizes = np.clip(np.minimum((centers + support + 0.5).astype(np.int64), in_size) - starts, 0, taps)
    j = np.arange(taps)
    raw = _cubic((j[None, :] + starts[:, None] - centers[:, None] + 0.5) * invscale)
    raw = np.where(j[None, :] < sizes[:, None], raw, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # summed in tap order, as torch does
        total += raw[:, k]
    weights = np.where(total[:, None] != 0, raw / np.where(total == 0, 1.0, total)[:, None], raw)
    largest = float(weights.max(initial=0.0))
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    quantised = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return starts, quantised, precision


def _resize_axis(array: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """uint8 array resampled along `axis` to out_size, one torch pass."""
    in_size = array.shape[axis]
    if in_size == out_size:
        return array
    starts, weights, precision = _weights(in_size, out_size)
    moved = np.moveaxis(array, axis, -1).astype(np.int64)
    total = np.full((*moved.shape[:-1], out_size), 1 << (precision - 1) if precision else 0, dtype=np.int64)
    for k in range(weights.shape[1]):
        index = np.minimum(starts + k, in_size - 1)  # a tap past the edge has weight 0
        total += moved[..., index] * weights[:, k]
    return np.moveaxis(np.clip(total >> precision, 0, 255).astype(np.uint8), -1, axis)


def resize_uint8(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [..., C, H, W] resized to height x width as torchvision resizes a uint8 tensor with BICUBIC."""
    if frames.shape[-2:] == (height, width):
        return frames  # torchvision returns the tensor untouched
    result = _resize_axis(frames, width, frames.ndim - 1)
    return _resize_axis(result, height, frames.ndim - 2)
