"""Preallocated KV cache: per layer one key and one value buffer [B, H_kv, C, D], bound in place.

The buffers are allocated once per (batch, capacity bucket) and the graphs write new rows into them
(past_* and present_* are bound to the same buffer). `past_lens` tracks how many positions each
row holds; nothing may write past the capacity C, so every run is checked first.

`CacheState` is the host-side part every backend shares (fill levels, capacity rules); `KVCache`
adds ONNX Runtime OrtValues on the CPU or a CUDA device. The TensorRT backend has its own device
buffers (runtime/trt_backend.py).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.contract import KVLayout, cache_input
from kvforge.errors import CapacityError, InputError, ManifestError

KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}  # int8: `export --kv-cache int8`
# numpy has no bfloat16: device caches of that type are made from ONNX's element type number.
ONNX_BFLOAT16 = 16


def needed_positions(prompt_lens: list[int], max_new_tokens: int) -> int:
    """Cache positions a request writes: the longest prompt plus every generated token but the
    last, which is returned and never fed back."""
    return max(prompt_lens) + max_new_tokens - 1


def choose_capacity(
    needed: int, max_capacity: int, requested: int | None = None, buckets: tuple[int, ...] | None = None
) -> int:
    """The capacity C to allocate: `requested` if given, else the smallest of `buckets` that holds
    the request (exactly what it needs when no buckets are given)."""
    if needed > max_capacity:
        raise CapacityError(
            f"the request needs {needed} positions (longest prompt + max_new_tokens - 1) but the export "
            f"allows at most {max_capacity}; shorten the prompt or lower max_new_tokens"
        )
    if requested is None:
        if buckets:
            return next((b for b in buckets if b >= needed), max_capacity)
        return needed
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 1:
        raise InputError(f"capacity must be a positive integer, got {requested!r}")
    if requested > max_capacity:
        raise CapacityError(
            f"capacity {requested} exceeds the export's max_capacity {max_capacity}; pass at most {max_capacity}"
        )
    if needed > requested:
        raise CapacityError(
            f"the request needs {needed} positions but the KV cache holds {requested}; "
            f"raise capacity (max {max_capacity})"
        )
    return int(requested)


class CacheState:
    """The host-side state of a KV cache: shape, per-row fill levels and the capacity checks."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: str, max_capacity: int | None = None) -> None:
        self.num_layers = num_layers
        self.shape = (batch, num_kv_heads, capacity, head_dim)
        self.dtype = dtype
        self.capacity = capacity
        self.max_capacity = max_capacity if max_capacity is not None else capacity
        self.past_lens = np.zeros(batch, dtype=np.int32)

    @property
    def batch(self) -> int:
        return self.shape[0]

    def reset(self) -> None:
        """Forget the contents (stale rows are overwritten before they are ever attended)."""
        self.past_lens[:] = 0

    def check_fits(self, new_tokens: int, rows: np.ndarray | None = None) -> None:
        """Raise CapacityError if writing `new_tokens` more positions would pass the capacity
        for any row (or for the rows selected by the boolean mask `rows`)."""
        lens = self.past_lens if rows is None else self.past_lens[rows]
        if lens.size == 0:
            return
        needed = int(lens.max()) + int(new_tokens)
        if needed > self.capacity:
            raise CapacityError(
                f"this step needs {needed} positions but the KV cache holds {self.capacity}; "
                f"raise capacity (max {self.max_capacity})"
            )


class KVCache(CacheState):
    """ONNX Runtime key/value buffers (OrtValues on the CPU or a CUDA device) for every layer."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: str = "float32",
        device: str = "cpu",
        device_id: int = 0,
        max_capacity: int | None = None,
    ) -> None:
        if dtype not in KV_DTYPES and not (dtype == "bfloat16" and device != "cpu"):
            raise ManifestError(f"KV cache dtype {dtype!r} is not supported; expected one of {sorted(KV_DTYPES)}")
        super().__init__(num_layers, batch, num_kv_heads, capacity, head_dim, dtype, max_capacity)
        self.device = device
        np_dtype = KV_DTYPES.get(dtype)
        # On CPU the OrtValues wrap these numpy arrays (no copy); keep them alive as long as the cache.
        self._host: list[np.ndarray] = []
        self.keys: list[ort.OrtValue] = []
        self.values: list[ort.OrtValue] = []
        for _ in range(num_layers):
            for store in (self.keys, self.values):
                if device == "cpu":
                    array = np.zeros(self.shape, dtype=np_dtype)
                    self._host.append(array)
                    store.append(ort.OrtValue.ortvalue_from_numpy(array))
                else:
                    element = np_dtype if np_dtype is not None else ONNX_BFLOAT16
                    value = ort.OrtValue.ortvalue_from_shape_and_type(self.shape, element, device, device_id)
                    # Zero once so that reads of never-written rows are deterministic (debugging only:
                    # the graphs never attend them). bfloat16 zero has the bits of uint16 zero.
                    value.update_inplace(np.zeros(self.shape, dtype=np_dtype or np.uint16))
                    store.append(value)

    @classmethod
    def from_manifest(
        cls, manifest: dict[str, Any], batch: int, capacity: int, device: str = "cpu", device_id: int = 0
    ) -> KVCache:
        kv = KVLayout.from_manifest(manifest)
        return cls(
            num_layers=kv.num_layers,
            batch=batch,
            num_kv_heads=kv.num_kv_heads,
            capacity=capacity,
            head_dim=kv.head_dim,
            dtype=kv.dtype,
            device=device,
            device_id=device_id,
            max_capacity=kv.max_capacity,
        )

    def host_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The CPU buffers themselves (not copies), (key, value) per layer: the serving scheduler
        moves rows between caches with them. Device caches have none."""
        if self.device != "cpu":
            raise InputError(f"the KV cache lives on {self.device}; only CPU caches expose host buffers")
        return [(self._host[2 * i], self._host[2 * i + 1]) for i in range(self.num_layers)]

    def first_rows(self, rows: int) -> KVCache:
        """A cache over the first `rows` rows of this one, in the same memory: the leading rows of a
        row-major [B, H, C, D] buffer are one contiguous block, so the new OrtValues wrap views, and
        `past_lens` is a view too. Binding it runs a smaller batch in place (the scheduler's buckets)."""
        if self.device != "cpu":
            raise InputError(f"the KV cache lives on {self.device}; only CPU caches give row views")
        if not 1 <= rows <= self.batch:
            raise InputError(f"rows must be between 1 and the cache's {self.batch}, got {rows!r}")
        view = copy.copy(self)
        view.shape = (rows, *self.shape[1:])
        view.past_lens = self.past_lens[:rows]
        view._host = [array[:rows] for array in self._host]
        view.keys = [ort.OrtValue.ortvalue_from_numpy(array) for array in view._host[0::2]]
        view.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in view._host[1::2]]
        return view

    def addresses(self) -> dict[str, int]:
        """Device address of every buffer, by graph input name."""
        out = {}
        for i, (key, value) in enumerate(zip(self.keys, self.values, strict=True)):
            out[cache_input("key", i)] = key.data_ptr()
            out[cache_input("value", i)] = value.data_ptr()
        return out

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of layer `layer`'s key and value buffers as numpy arrays (for tests and debugging)."""
        return self.keys[layer].numpy().copy(), self.values[layer].numpy().copy()
