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

from kvforge.core.contract import KVLayout, cache_input
from kvforge.core.errors import CapacityError, InputError, ManifestError

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

    def first_rows(self, rows: int) -> CacheState:
        """The state of the first `rows` rows: the same `past_lens` memory (a view), a smaller batch."""
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 1 <= rows <= self.batch:
            raise InputError(f"rows must be between 1 and the cache's {self.batch}, got {rows!r}")
        view = copy.copy(self)
        view.shape = (int(rows), *self.shape[1:])
        view.past_lens = self.past_lens[:rows]
        return view

    def check_row(self, row: int, positions: int) -> None:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.batch:
            raise InputError(f"row {row!r} is outside the cache's {self.batch} rows")
        if not 0 <= positions <= self.capacity:
            raise CapacityError(f"{positions} positions do not fit the cache's capacity {self.capacity}")

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


# -- rows of device buffers -----------------------------------------------------------------------
# A cache row's positions 0..n-1 in a [B, H, C, D] buffer are H blocks of n * D elements, C * D apart:
# one 2-D copy per buffer (kvforge.core.cuda.copy_2d). Buffers are given by address, key 0, value 0, key 1, ...


def _geometry(cache: CacheState, itemsize: int) -> tuple[int, int, int]:
    """(bytes of one position of one head, bytes between heads, bytes between rows)."""
    position = cache.shape[3] * itemsize
    pitch = cache.capacity * position
    return position, pitch, cache.shape[1] * pitch


def device_copy_rows(src: CacheState, src_pointers: list[int], row: int, dst: CacheState, dst_pointers: list[int],
                     dst_row: int, positions: int, itemsize: int) -> None:
    """Copy positions 0..positions-1 of `row` of every buffer to `dst_row` of `dst`'s, on the device."""
    from kvforge.core import cuda

    position, src_pitch, src_stride = _geometry(src, itemsize)
    _, dst_pitch, dst_stride = _geometry(dst, itemsize)
    for source, target in zip(src_pointers, dst_pointers, strict=True):
        cuda.copy_2d(target + dst_row * dst_stride, dst_pitch, source + row * src_stride, src_pitch,
                     positions * position, src.shape[1], "device_to_device")
    cuda.synchronize()  # the next run is on the backend's own stream, which does not wait for these


def device_read_rows(cache: CacheState, pointers: list[int], row: int, positions: int,
                     dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    """Host copies [H, positions, D] of `row`'s first positions, (key, value) per layer."""
    from kvforge.core import cuda

    position, pitch, stride = _geometry(cache, dtype.itemsize)
    out = []
    for pointer in pointers:
        array = np.empty((cache.shape[1], positions, cache.shape[3]), dtype=dtype)
        cuda.copy_2d(array.ctypes.data, positions * position, pointer + row * stride, pitch,
                     positions * position, cache.shape[1], "device_to_host")
        out.append(array)
    return list(zip(out[0::2], out[1::2], strict=True))


def device_write_rows(cache: CacheState, pointers: list[int], row: int, layers: list[tuple[np.ndarray, np.ndarray]],
                      positions: int, dtype: np.dtype) -> None:
    """Write `row`'s first positions from host arrays in device_read_rows' form."""
    from kvforge.core import cuda

    position, pitch, stride = _geometry(cache, dtype.itemsize)
    arrays = [np.ascontiguousarray(array, dtype=dtype) for pair in layers for array in pair]
    for pointer, array in zip(pointers, arrays, strict=True):
        cuda.copy_2d(pointer + row * stride, pitch, array.ctypes.data, array.shape[1] * position,
                     positions * position, cache.shape[1], "host_to_device")
    cuda.synchronize()


def check_row_arrays(cache: CacheState, layers: list[tuple[np.ndarray, np.ndarray]], positions: int) -> None:
    """`layers` must be read_rows' form for this cache, at least `positions` long."""
    if len(layers) != cache.num_layers:
        raise InputError(f"{len(layers)} layers of rows given for a cache of {cache.num_layers}")
    for pair in layers:
        for array in pair:
            if array.ndim != 3 or array.shape[0] != cache.shape[1] or array.shape[1] < positions \
                    or array.shape[2] != cache.shape[3]:
                raise InputError(f"rows of shape {array.shape} do not fit a cache of shape {cache.shape}")


class KVCache(CacheState):
    """ONNX Runtime key/value buffers (OrtValues on the CPU or a CUDA device) for every layer.

    Row operations (`copy_rows`, `read_rows`, `write_rows`, `first_rows`) move the written positions of
    one batch row: numpy on the CPU, CUDA copies on a device (through cuda-python, kvforge.core.cuda), so
    a cache never leaves its device for them, except `read_rows`, whose copies go to host memory."""

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
        on_device: bool | None = None,
    ) -> None:
        """`on_device`: treat the buffers as device memory (CUDA copies for row operations); default: a
        device other than "cpu". Tests set it on the CPU to run the device code over host memory."""
        if dtype not in KV_DTYPES and not (dtype == "bfloat16" and device != "cpu"):
            raise ManifestError(f"KV cache dtype {dtype!r} is not supported; expected one of {sorted(KV_DTYPES)}")
        super().__init__(num_layers, batch, num_kv_heads, capacity, head_dim, dtype, max_capacity)
        self.device = device
        self.device_id = device_id
        self.on_device = device != "cpu" if on_device is None else bool(on_device)
        np_dtype = KV_DTYPES.get(dtype)
        # bfloat16 has no numpy type: its rows travel to the host as uint16 (the same bits).
        self.host_dtype = np.dtype(np_dtype if np_dtype is not None else np.uint16)
        # On CPU the OrtValues wrap these numpy arrays (no copy); keep them alive as long as the cache.
        self._host: list[np.ndarray] = []
        self.keys: list[ort.OrtValue] = []
        self.values: list[ort.OrtValue] = []
        # A view (first_rows) of a device cache: the base cache's buffers, which it keeps alive.
        self._base: KVCache | None = None
        for _ in range(num_layers):
            for store in (self.keys, self.values):
                if not self.on_device:
                    array = np.zeros(self.shape, dtype=np_dtype)
                    self._host.append(array)
                    store.append(ort.OrtValue.ortvalue_from_numpy(array))
                else:
                    element = np_dtype if np_dtype is not None else ONNX_BFLOAT16
                    value = ort.OrtValue.ortvalue_from_shape_and_type(self.shape, element, device, device_id)
                    # Device memory comes uninitialised: zero it once, so that a read of a never-written
                    # position (padding a graph masks, a row view's frozen rows) is a read of zeros, not
                    # of NaN bit patterns left by an earlier allocation.
                    value.update_inplace(np.zeros(self.shape, dtype=self.host_dtype))
                    store.append(value)
        self._pointers = [value.data_ptr() for pair in zip(self.keys, self.values, strict=True) for value in pair]

    @classmethod
    def from_manifest(
        cls, manifest: dict[str, Any], batch: int, capacity: int, device: str = "cpu", device_id: int = 0,
        on_device: bool | None = None,
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
            on_device=on_device,
        )

    def buffer_pointers(self) -> list[int]:
        """Device (or host) address of every buffer: key 0, value 0, key 1, ..."""
        return list(self._pointers)

    def host_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The CPU buffers themselves (not copies), (key, value) per layer. Device caches have none."""
        if self.on_device:
            raise InputError(f"the KV cache lives on {self.device}; only CPU caches expose host buffers")
        return [(self._host[2 * i], self._host[2 * i + 1]) for i in range(self.num_layers)]

    def first_rows(self, rows: int) -> KVCache:
        """A cache over the first `rows` rows of this one, in the same memory: the leading rows of a
        row-major [B, H, C, D] buffer are one contiguous block. `past_lens` is a view too. Binding it
        runs a smaller batch in place (the scheduler's batch buckets). On a device the view has no
        OrtValues of its own (ONNX Runtime's Python API cannot wrap a device address): backends bind
        its `buffer_pointers()` with its shape."""
        view = super().first_rows(rows)
        assert isinstance(view, KVCache)
        if self.on_device:
            view._base = self._base or self
            view.keys, view.values = [], []
            return view
        view._host = [array[:rows] for array in self._host]
        view.keys = [ort.OrtValue.ortvalue_from_numpy(array) for array in view._host[0::2]]
        view.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in view._host[1::2]]
        return view

    # -- row operations ------------------------------------------------------------------------
    def copy_rows(self, row: int, dst: KVCache, dst_row: int, positions: int) -> None:
        """Copy positions 0..positions-1 of `row` (every layer, key and value) into `dst_row` of `dst`
        (this cache or another of the same layout, on the same device)."""
        self.check_row(row, positions)
        dst.check_row(dst_row, positions)
        if (dst.on_device, dst.num_layers, dst.shape[1], dst.shape[3], dst.dtype) != (
                self.on_device, self.num_layers, self.shape[1], self.shape[3], self.dtype):
            raise InputError("rows move only between KV caches of the same layout on the same device")
        if positions == 0:
            return
        if not self.on_device:
            for src, out in zip(self._host, dst._host, strict=True):
                out[dst_row, :, :positions] = src[row, :, :positions]
            return
        self._current_device()
        device_copy_rows(self, self._pointers, row, dst, dst._pointers, dst_row, positions, self.host_dtype.itemsize)

    def read_rows(self, row: int, positions: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Host copies of positions 0..positions-1 of `row`: (key, value) per layer, [H, positions, D]
        (bfloat16 as uint16 bits). What the serving scheduler keeps for a later turn's prefix."""
        self.check_row(row, positions)
        if not self.on_device:
            return [(k[row, :, :positions].copy(), v[row, :, :positions].copy()) for k, v in self.host_layers()]
        self._current_device()
        return device_read_rows(self, self._pointers, row, positions, self.host_dtype)

    def write_rows(self, row: int, layers: list[tuple[np.ndarray, np.ndarray]], positions: int) -> None:
        """Write positions 0..positions-1 of `row` from `layers` (read_rows' form, at least `positions` long)."""
        self.check_row(row, positions)
        check_row_arrays(self, layers, positions)
        if not self.on_device:
            for (k, v), (key, value) in zip(self.host_layers(), layers, strict=True):
                k[row, :, :positions] = key[:, :positions]
                v[row, :, :positions] = value[:, :positions]
            return
        self._current_device()
        device_write_rows(self, self._pointers, row, layers, positions, self.host_dtype)

    def _current_device(self) -> None:
        from kvforge.core import cuda

        cuda.set_device(self.device_id)

    def addresses(self) -> dict[str, int]:
        """Device address of every buffer, by graph input name."""
        out = {}
        for i in range(self.num_layers):
            out[cache_input("key", i)] = self._pointers[2 * i]
            out[cache_input("value", i)] = self._pointers[2 * i + 1]
        return out

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of layer `layer`'s key and value buffers as numpy arrays (for tests and debugging)."""
        if self._base is not None:  # a device view: its rows of the base cache
            key, value = self._base.read(layer)
            return key[: self.batch].copy(), value[: self.batch].copy()
        return self.keys[layer].numpy().copy(), self.values[layer].numpy().copy()
