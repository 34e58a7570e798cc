"""A KV cache bound to an OrtBackend's sessions (runtime/backends/ort_backend.py): the slot one request runs on, and
the binding of its buffers (host OrtValues, or a device view's addresses)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import buffer_name, cache_input, cache_output
from kvforge.runtime.backends.device_pick import PickBinding
from kvforge.runtime.backends.kv_cache import KVCache


@dataclass
class OrtSlot:
    """A KV cache bound to the backend's sessions: what one request (or one thread) runs on."""

    cache: KVCache
    bindings: dict[str, ort.IOBinding]
    output_order: dict[str, list[str]]
    logits: np.ndarray  # [B, V], bound as the logits output of both phases
    decode_ids: np.ndarray  # [B, 1], bound as the decode input_ids
    decode_index: np.ndarray  # [B, 1] zeros: single mode's logits_index for S=1
    host_values: dict[str, ort.OrtValue] = field(default_factory=dict)
    prefill_inputs: tuple[np.ndarray, ...] = ()  # kept alive until the run (bind_cpu_input does not copy)
    # ort-cuda: past_lens, the decode token ids, single mode's logits index and the decode logits, on
    # the device (fixed addresses: what a CUDA graph replays); and the decode runs' options (graph id).
    device_values: dict[str, ort.OrtValue] = field(default_factory=dict)
    decode_options: ort.RunOptions | None = None
    # ort-cuda with device greedy: the pick graph's binding over the decode logits and the device buffer
    # it fills (each row's argmax, and its logits' sum: the NaN check), runtime/backends/device_pick.py
    pick: PickBinding | None = None
    decode_positions: np.ndarray | None = None  # an M-RoPE decode step's through the prefill graph, kept alive


def bind_buffer(binding: ort.IOBinding, cache: KVCache, layer: int, kind: str, device: str, device_id: int) -> None:
    """Bind one cache buffer as both past_* and present_*: its OrtValue, or (a device view, which has none) its
    address with the view's shape."""
    name = buffer_name(kind, layer)
    if cache.buffer_values:
        buffer = cache.buffer_values[name]
        binding.bind_ortvalue_input(cache_input(kind, layer), buffer)
        binding.bind_ortvalue_output(cache_output(kind, layer), buffer)
        return
    index = cache.buffers().index((layer, kind))
    pointer, dtype = cache.buffer_pointers()[index], cache.host_dtypes[index]
    shape = list(cache.buffer_shape(layer, kind))
    binding.bind_input(cache_input(kind, layer), device, device_id, dtype, shape, pointer)
    binding.bind_output(cache_output(kind, layer), device, device_id, dtype, shape, pointer)


def device_array(device: str, device_id: int, array: np.ndarray) -> ort.OrtValue:
    """A device OrtValue holding a copy of `array` (so it starts initialised)."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, device, device_id)
    value.update_inplace(np.ascontiguousarray(array))
    return value
