"""A one-row view of a batch cache: row `at` of a slot's KV buffers bound as a batch of 1, in place.

ONNX Runtime's GroupQueryAttention (the `ort` target, Limits.continue_batch == 1) extends at most one row by
several tokens after a past, so the serving scheduler verifies each speculative row in a call of its own. A
row's keys and values are one contiguous block of a row-major [B, H, C, D] buffer (a state's row too), so an
OrtValue over that block (host memory: a numpy slice; a device: the buffer's address plus the row's offset)
is the row itself; `past_lens` is a one-element view. A run on the view writes that row only.

    view = backend.row_view(slot, 3)      # batch 1, cache.row_offset == 3
    backend.prefill(view, ids[None], index[None])
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.runtime.backends.kv_cache import KVCache


def row_cache(cache: KVCache, at: int) -> KVCache | None:
    """Row `at` of `cache` as a cache of batch 1 over the same memory (`row_offset`: at); None where it cannot
    be bound (a bf16 cache on a device: numpy has no bfloat16 to bind it with)."""
    cache.check_row(at, 0)
    if cache.on_device and cache.dtype == "bfloat16":
        return None
    view = copy.copy(cache)
    view.shape = (1, *cache.shape[1:])
    view.past_lens = cache.past_lens[at: at + 1]
    view.rope_deltas = cache.rope_deltas[at: at + 1]
    view.row_offset = at
    if cache.on_device:
        view._base = cache._base or cache
        view.buffer_values = {}
        sizes = [int(np.prod(shape[1:])) * dtype.itemsize
                 for shape, dtype in zip(cache.buffer_shapes(), cache.host_dtypes, strict=True)]
        view._pointers = [pointer + at * size for pointer, size in zip(cache.buffer_pointers(), sizes, strict=True)]
        return view
    view._host = {key: array[at: at + 1] for key, array in cache._host.items()}
    view.buffer_values = {key: ort.OrtValue.ortvalue_from_numpy(array) for key, array in view._host.items()}
    return view


def row_view(backend: Any, slot: Any, at: int) -> Any:
    """OrtBackend.row_view: a slot over row `at` of `slot`'s cache (its own bindings and logits buffer), or None
    where the cache has no row views."""
    cache = row_cache(slot.cache, at)
    return None if cache is None else backend.bind(cache)
