"""Preallocated KV cache: per layer one key and one value buffer [B, H_kv, C, D], bound in place.

The buffers are allocated once per (batch, capacity bucket) and the graphs write new rows into them
(past_* and present_* are bound to the same buffer). `past_lens` tracks how many positions each
row holds; nothing may write past the capacity C, so every run is checked first.

`CacheState` is the host-side part every backend shares (fill levels, capacity rules); `KVCache`
adds ONNX Runtime OrtValues on the CPU or a CUDA device. The TensorRT backend has its own device
buffers (runtime/backends/trt_backend.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import KV_KINDS, KVLayout, StateSpec, buffer_name, cache_input
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
    """The host-side state of a cache: its buffers' shapes, per-row fill levels and the capacity checks.

    Buffers in the contract's order (KVLayout.buffers): an attention layer's key and value [B, H_kv, C, D],
    then a recurrent layer's states [B, *shape]. `layer_shapes` gives each layer's (H_kv, D) where layers
    differ (None: no KV), `states` the recurrent states; `shape` is the first KV buffer's."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: str, max_capacity: int | None = None,
                 layer_shapes: Sequence[tuple[int, int] | None] = (), states: Sequence[StateSpec] = ()) -> None:
        self.num_layers = num_layers
        self.layer_shapes = tuple(layer_shapes) or ((num_kv_heads, head_dim),) * num_layers
        if len(self.layer_shapes) != num_layers:
            raise InputError(f"{len(self.layer_shapes)} layer shapes given for a cache of {num_layers} layers")
        self.states = tuple(states)
        self.layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype, max_capacity or capacity,
                               layers=tuple(layer_shapes), states=self.states)
        first = next((shape for shape in self.layer_shapes if shape is not None), (num_kv_heads, head_dim))
        self.shape = (batch, first[0], capacity, first[1])
        self.dtype = dtype
        self.capacity = capacity
        self.max_capacity = max_capacity if max_capacity is not None else capacity
        self.past_lens = np.zeros(batch, dtype=np.int32)
        # An M-RoPE export's per-row offset of the rotary positions from past_lens (contract.ROPE_DELTAS), set
        # when a row's prompt is placed; 0 for a text row, and unused by any other export.
        self.rope_deltas = np.zeros(batch, dtype=np.int64)

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a recurrent state (exact only at the token it was taken: no rollback)."""
        return bool(self.states)

    def buffers(self) -> list[tuple[int, str]]:
        """(layer, kind) of every buffer, in buffer order."""
        return self.layout.buffers()

    def buffer_shape(self, layer: int, kind: str = "key") -> tuple[int, ...]:
        """The shape of `layer`'s `kind` buffer: [B, H_kv, C, D] for a key or value, [B, *shape] for a state."""
        return self.layout.buffer_shape(self.shape[0], self.capacity, layer, kind)

    def buffer_shapes(self) -> list[tuple[int, ...]]:
        """Every buffer's shape in buffer order."""
        return [self.buffer_shape(layer, kind) for layer, kind in self.buffers()]

    def buffer_dtypes(self) -> list[str]:
        return [self.layout.buffer_dtype(layer, kind) for layer, kind in self.buffers()]

    def reset(self) -> None:
        """Forget the contents (stale rows are overwritten before they are ever attended; a row's recurrent
        state is read as zeros by a graph run at its position 0)."""
        self.past_lens[:] = 0  # (rope_deltas belong to the rows placed: the engine sets them as it places rows)

    def text_positions(self, seq: int) -> np.ndarray:
        """[3, B, seq] int64: the multimodal positions of a call of text tokens (contract.POSITION_IDS), the three
        streams equal to past_lens[b] + t + rope_deltas[b]."""
        row = self.past_lens.astype(np.int64) + self.rope_deltas
        return np.ascontiguousarray(np.broadcast_to(row[:, None] + np.arange(seq, dtype=np.int64),
                                                    (3, self.batch, seq)))

    def first_rows(self, rows: int) -> CacheState:
        """The state of the first `rows` rows: the same `past_lens` memory (a view), a smaller batch."""
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 1 <= rows <= self.batch:
            raise InputError(f"rows must be between 1 and the cache's {self.batch}, got {rows!r}")
        view = copy.copy(self)
        view.shape = (int(rows), *self.shape[1:])
        view.past_lens = self.past_lens[:rows]
        view.rope_deltas = self.rope_deltas[:rows]
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


def host_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a buffer's rows travel to the host as (bfloat16 as uint16: the same bits)."""
    return np.dtype(KV_DTYPES.get(dtype, np.uint16))


# -- rows of device buffers -----------------------------------------------------------------------
# A cache row's positions 0..n-1 in a [B, H, C, D] buffer are H blocks of n * D elements, C * D apart:
# one 2-D copy per buffer (kvforge.core.cuda.copy_2d). A state's row is one contiguous block. Buffers are
# given by address, in buffer order.


def _geometry(shape: tuple[int, ...], kind: str, itemsize: int, positions: int) -> tuple[int, int, int, int]:
    """(bytes copied per block, bytes between blocks, blocks per row, bytes between rows) of `positions`
    positions of a row: a key or value buffer's per head; a state's whole row, once."""
    if kind in KV_KINDS:
        position = shape[3] * itemsize
        pitch = shape[2] * position
        return positions * position, pitch, shape[1], shape[1] * pitch
    row = math.prod(shape[1:]) * itemsize
    return row, row, 1, row


def _dtypes(dtype: np.dtype | Sequence[np.dtype], count: int) -> list[np.dtype]:
    return list(dtype) if isinstance(dtype, (list, tuple)) else [np.dtype(dtype)] * count


def device_copy_rows(src: CacheState, src_pointers: list[int], row: int, dst: CacheState, dst_pointers: list[int],
                     dst_row: int, positions: int, itemsize: int | Sequence[int]) -> None:
    """Copy positions 0..positions-1 of `row` of every buffer (a state: all of it) to `dst_row` of `dst`'s, on
    the device. `itemsize`: one for every buffer, or one per buffer."""
    from kvforge.core import cuda

    sizes = list(itemsize) if isinstance(itemsize, (list, tuple)) else [itemsize] * len(src_pointers)
    kinds = [kind for _, kind in src.buffers()]
    for source, target, src_shape, dst_shape, size, kind in zip(src_pointers, dst_pointers, src.buffer_shapes(),
                                                                dst.buffer_shapes(), sizes, kinds, strict=True):
        width, src_pitch, blocks, src_stride = _geometry(src_shape, kind, size, positions)
        _, dst_pitch, _, dst_stride = _geometry(dst_shape, kind, size, positions)
        if width:
            cuda.copy_2d(target + dst_row * dst_stride, dst_pitch, source + row * src_stride, src_pitch,
                         width, blocks, "device_to_device")
    cuda.synchronize()  # the next run is on the backend's own stream, which does not wait for these


def _row_arrays(cache: CacheState, arrays: list[np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """Per layer, its buffers' row arrays in buffer order: (key, value), (conv0, recurrent0), ..."""
    by_layer: list[list[np.ndarray]] = [[] for _ in range(cache.num_layers)]
    for (layer, _), array in zip(cache.buffers(), arrays, strict=True):
        by_layer[layer].append(array)
    return [tuple(arrays) for arrays in by_layer]


def device_read_rows(cache: CacheState, pointers: list[int], row: int, positions: int,
                     dtype: np.dtype | Sequence[np.dtype]) -> list[tuple[np.ndarray, ...]]:
    """Host copies of `row`: per layer, a key and value's [H, positions, D] first positions, a state's
    whole row."""
    from kvforge.core import cuda

    out = []
    for pointer, shape, (_, kind), element in zip(pointers, cache.buffer_shapes(), cache.buffers(),
                                                  _dtypes(dtype, len(pointers)), strict=True):
        width, pitch, blocks, stride = _geometry(shape, kind, element.itemsize, positions)
        array = np.empty((shape[1], positions, shape[3]) if kind in KV_KINDS else shape[1:], dtype=element)
        if width:
            cuda.copy_2d(array.ctypes.data, width, pointer + row * stride, pitch, width, blocks, "device_to_host")
        out.append(array)
    return _row_arrays(cache, out)


def device_write_rows(cache: CacheState, pointers: list[int], row: int, layers: list[tuple[np.ndarray, ...]],
                      positions: int, dtype: np.dtype | Sequence[np.dtype]) -> None:
    """Write `row` from host arrays in device_read_rows' form."""
    from kvforge.core import cuda

    elements = _dtypes(dtype, len(pointers))
    arrays = [np.ascontiguousarray(array, dtype=element)
              for array, element in zip([a for layer in layers for a in layer], elements, strict=True)]
    for pointer, array, shape, (_, kind), element in zip(pointers, arrays, cache.buffer_shapes(), cache.buffers(),
                                                         elements, strict=True):
        width, pitch, blocks, stride = _geometry(shape, kind, element.itemsize, positions)
        source_pitch = array.shape[1] * shape[3] * element.itemsize if kind in KV_KINDS else width
        if width:
            cuda.copy_2d(pointer + row * stride, pitch, array.ctypes.data, source_pitch, width, blocks,
                         "host_to_device")
    cuda.synchronize()


def check_row_arrays(cache: CacheState, layers: list[tuple[np.ndarray, ...]], positions: int) -> None:
    """`layers` must be read_rows' form for this cache, at least `positions` long."""
    if len(layers) != cache.num_layers:
        raise InputError(f"{len(layers)} layers of rows given for a cache of {cache.num_layers}")
    for layer, arrays in enumerate(layers):
        kinds = cache.layout.layer_buffers(layer)
        if len(arrays) != len(kinds):
            raise InputError(f"layer {layer}'s rows hold {len(arrays)} buffers, its cache {len(kinds)} ({kinds})")
        for array, kind in zip(arrays, kinds, strict=True):
            shape = cache.buffer_shape(layer, kind)
            if kind in KV_KINDS:
                fits = array.ndim == 3 and array.shape[0] == shape[1] and array.shape[1] >= positions \
                    and array.shape[2] == shape[3]
            else:
                fits = tuple(array.shape) == tuple(shape[1:])
            if not fits:
                raise InputError(f"rows of shape {array.shape} do not fit layer {layer}'s {kind} cache of shape {shape}")


class KVCache(CacheState):
    """ONNX Runtime cache buffers (OrtValues on the CPU or a CUDA device) for every layer: keys and values,
    and recurrent states.

    Row operations (`copy_rows`, `read_rows`, `write_rows`, `first_rows`) move one batch row: the written
    positions of its keys and values, all of its states. numpy on the CPU, CUDA copies on a device (through
    cuda-python, kvforge.core.cuda), so a cache never leaves its device for them, except `read_rows`, whose
    copies go to host memory."""

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
        layer_shapes: Sequence[tuple[int, int] | None] = (),
        states: Sequence[StateSpec] = (),
    ) -> None:
        """`on_device`: treat the buffers as device memory (CUDA copies for row operations); default: a
        device other than "cpu". Tests set it on the CPU to run the device code over host memory.
        `layer_shapes`, `states`: KVLayout.layers and .states."""
        super().__init__(num_layers, batch, num_kv_heads, capacity, head_dim, dtype, max_capacity, layer_shapes,
                         states)
        for name in {dtype, *(spec.dtype for spec in self.states)}:
            if name not in KV_DTYPES and not (name == "bfloat16" and device != "cpu"):
                raise ManifestError(f"KV cache dtype {name!r} is not supported; expected one of {sorted(KV_DTYPES)}")
        self.device = device
        self.device_id = device_id
        self.on_device = device != "cpu" if on_device is None else bool(on_device)
        # Rows travel to the host in these (bfloat16 as uint16: the same bits); one per buffer.
        self.host_dtypes = [host_dtype(name) for name in self.buffer_dtypes()]
        self.host_dtype = host_dtype(dtype)
        # On CPU the OrtValues wrap these numpy arrays (no copy); keep them alive as long as the cache.
        self._host: dict[str, np.ndarray] = {}
        self.buffer_values: dict[str, ort.OrtValue] = {}
        # A view (first_rows) of a device cache: the base cache's buffers, which it keeps alive.
        self._base: KVCache | None = None
        for (layer, kind), name, kind_dtype in zip(self.buffers(), self.buffer_dtypes(), self.host_dtypes, strict=True):
            shape = self.buffer_shape(layer, kind)
            key = buffer_name(kind, layer)
            if not self.on_device:
                array = np.zeros(shape, dtype=kind_dtype)
                self._host[key] = array
                self.buffer_values[key] = ort.OrtValue.ortvalue_from_numpy(array)
            else:
                element = KV_DTYPES[name] if name in KV_DTYPES else ONNX_BFLOAT16
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, element, device, device_id)
                # Device memory comes uninitialised: zero it once, so that a read of a never-written
                # position (padding a graph masks, a row view's frozen rows) is a read of zeros, not
                # of NaN bit patterns left by an earlier allocation.
                value.update_inplace(np.zeros(shape, dtype=kind_dtype))
                self.buffer_values[key] = value
        self._pointers = [value.data_ptr() for value in self.buffer_values.values()]

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
            layer_shapes=kv.layers,
            states=kv.states,
        )

    @property
    def keys(self) -> list[ort.OrtValue]:
        """The key buffers of the layers that keep KV (a device view has none: bind its addresses)."""
        return [self.buffer_values[buffer_name("key", layer)] for layer, kind in self.buffers()
                if kind == "key" and self.buffer_values]

    @property
    def values(self) -> list[ort.OrtValue]:
        return [self.buffer_values[buffer_name("value", layer)] for layer, kind in self.buffers()
                if kind == "value" and self.buffer_values]

    def buffer_pointers(self) -> list[int]:
        """Device (or host) address of every buffer, in buffer order."""
        return list(self._pointers)

    def host_layers(self) -> list[tuple[np.ndarray, ...]]:
        """The CPU buffers themselves (not copies), per layer in buffer order ((key, value) for an attention
        layer). Device caches have none."""
        if self.on_device:
            raise InputError(f"the KV cache lives on {self.device}; only CPU caches expose host buffers")
        return _row_arrays(self, list(self._host.values()))

    def first_rows(self, rows: int) -> KVCache:
        """A cache over the first `rows` rows of this one, in the same memory: the leading rows of a
        row-major buffer are one contiguous block. `past_lens` is a view too. Binding it runs a smaller
        batch in place (the scheduler's batch buckets). On a device the view has no OrtValues of its own
        (ONNX Runtime's Python API cannot wrap a device address): backends bind its `buffer_pointers()`
        with its shape."""
        view = super().first_rows(rows)
        assert isinstance(view, KVCache)
        if self.on_device:
            view._base = self._base or self
            view.buffer_values = {}
            return view
        view._host = {key: array[:rows] for key, array in self._host.items()}
        view.buffer_values = {key: ort.OrtValue.ortvalue_from_numpy(array) for key, array in view._host.items()}
        return view

    # -- row operations ------------------------------------------------------------------------
    def copy_rows(self, row: int, dst: KVCache, dst_row: int, positions: int) -> None:
        """Copy positions 0..positions-1 of `row` (every layer's key and value, and all of its states) into
        `dst_row` of `dst` (this cache or another of the same layout, on the same device)."""
        self.check_row(row, positions)
        dst.check_row(dst_row, positions)
        if (dst.on_device, dst.layer_shapes, dst.states, dst.dtype) != (
                self.on_device, self.layer_shapes, self.states, self.dtype):
            raise InputError("rows move only between KV caches of the same layout on the same device")
        if positions == 0 and not self.states:
            return
        if not self.on_device:
            for (_, kind), src, out in zip(self.buffers(), self._host.values(), dst._host.values(), strict=True):
                if kind in KV_KINDS:
                    out[dst_row, :, :positions] = src[row, :, :positions]
                else:
                    out[dst_row] = src[row]
            return
        self._current_device()
        device_copy_rows(self, self._pointers, row, dst, dst._pointers, dst_row, positions,
                         [dtype.itemsize for dtype in self.host_dtypes])

    def read_rows(self, row: int, positions: int) -> list[tuple[np.ndarray, ...]]:
        """Host copies of `row`: per layer in buffer order, a key and value's [H, positions, D] first
        positions (bfloat16 as uint16 bits) and a state's whole row. What the serving scheduler keeps for a
        later turn's prefix (a state is that of exactly `positions` tokens)."""
        self.check_row(row, positions)
        if not self.on_device:
            return [tuple(a[row, :, :positions].copy() if kind in KV_KINDS else a[row].copy()
                          for a, kind in zip(arrays, self.layout.layer_buffers(layer), strict=True))
                    for layer, arrays in enumerate(self.host_layers())]
        self._current_device()
        return device_read_rows(self, self._pointers, row, positions, self.host_dtypes)

    def write_rows(self, row: int, layers: list[tuple[np.ndarray, ...]], positions: int) -> None:
        """Write positions 0..positions-1 of `row` (and its states) from `layers` (read_rows' form, at least
        `positions` long)."""
        self.check_row(row, positions)
        check_row_arrays(self, layers, positions)
        if not self.on_device:
            for layer, (buffers, arrays) in enumerate(zip(self.host_layers(), layers, strict=True)):
                for buffer, array, kind in zip(buffers, arrays, self.layout.layer_buffers(layer), strict=True):
                    if kind in KV_KINDS:
                        buffer[row, :, :positions] = array[:, :positions]
                    else:
                        buffer[row] = array
            return
        self._current_device()
        device_write_rows(self, self._pointers, row, layers, positions, self.host_dtypes)

    def _current_device(self) -> None:
        from kvforge.core import cuda

        cuda.set_device(self.device_id)

    def addresses(self) -> dict[str, int]:
        """Device address of every buffer, by graph input name."""
        return {cache_input(kind, layer): pointer
                for (layer, kind), pointer in zip(self.buffers(), self._pointers, strict=True)}

    def read(self, layer: int, kinds: tuple[str, ...] = KV_KINDS) -> tuple[np.ndarray, ...]:
        """Copies of layer `layer`'s buffers (default: key and value) as numpy arrays (for tests and debugging)."""
        if self._base is not None:  # a device view: its rows of the base cache
            return tuple(array[: self.batch].copy() for array in self._base.read(layer, kinds))
        return tuple(self.buffer_values[buffer_name(kind, layer)].numpy().copy() for kind in kinds)
