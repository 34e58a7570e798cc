"""The runtime's one seam: a backend runs an export's prefill and decode over KV caches it owns.

    backend = create_backend("ort-cpu", folder, manifest, threads=2)   # or "ort-cuda", "emulate", "trt"
    slot = backend.allocate(batch, capacity)      # KV cache on the backend's device, bound in place
    logits = backend.prefill(slot, input_ids, logits_index)   # [B, V] float32 on the host
    logits = backend.decode(slot, token_ids, running)         # one token per row
    backend.limits                                # the batch / capacity it was built for

A slot is what one request runs on: the cache buffers (bound as both past_* and present_*), their
bindings, and `slot.cache`, the host-side state the Generator advances (`past_lens`, capacity
checks). `Generator` knows only this protocol; backend options (ONNX Runtime's session mode and
threads, TensorRT's engine folder) are the backend's keyword arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvforge.errors import InputError
from kvforge.runtime.kv_cache import CacheState, capacity_buckets


@dataclass(frozen=True)
class Limits:
    """What a backend can run: batch rows, cache positions, and the capacities it allocates at."""

    max_batch: int | None  # None: no limit of its own
    max_capacity: int
    capacity_buckets: tuple[int, ...]
    # Most rows one prefill call may extend by several tokens at past_lens > 0 (speculative
    # verification, chunked prefill); None: as many as max_batch. ONNX Runtime's
    # GroupQueryAttention (the `ort` target) takes several new tokens after a past only at batch 1.
    continue_batch: int | None = None

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], max_batch: int | None = None,
                      max_capacity: int | None = None) -> Limits:
        cap = int(manifest["kv_cache"]["max_capacity"])
        if max_capacity is not None:
            cap = min(cap, int(max_capacity))
        return cls(max_batch, cap, capacity_buckets(cap), 1 if manifest["target"] == "ort" else None)


class Slot(Protocol):
    cache: CacheState


class Backend(Protocol):
    name: str
    limits: Limits
    runs: dict[str, int]  # graph runs per phase since load
    allocations: int  # KV caches allocated since load

    def allocate(self, batch: int, capacity: int) -> Slot: ...

    def prefill(self, slot: Slot, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray: ...

    def decode(self, slot: Slot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray: ...

    def kv_addresses(self, slot: Slot) -> dict[str, int]: ...

    def bound_output_addresses(self, slot: Slot, phase: str) -> dict[str, int]: ...

    def read_kv(self, slot: Slot, layer: int) -> tuple[np.ndarray, np.ndarray]: ...


def _ort_cpu(folder: Path, manifest: dict, **options: Any) -> Backend:
    from kvforge.runtime.ort_backend import OrtBackend

    return OrtBackend(folder, manifest, device="cpu", **options)


def _ort_cuda(folder: Path, manifest: dict, **options: Any) -> Backend:
    from kvforge.runtime.ort_backend import OrtBackend

    return OrtBackend(folder, manifest, device="cuda", **options)


def _emulate(folder: Path, manifest: dict, **options: Any) -> Backend:
    from kvforge.runtime.ort_backend import EmulateBackend

    return EmulateBackend(folder, manifest, **options)


def _trt(folder: Path, manifest: dict, **options: Any) -> Backend:
    from kvforge.runtime.trt_backend import TrtBackend

    return TrtBackend(folder, manifest, **options)


# name -> (factory, the export targets it runs)
REGISTRY: dict[str, tuple[Callable[..., Backend], tuple[str, ...]]] = {
    "ort-cpu": (_ort_cpu, ("ort", "onnx")),
    "ort-cuda": (_ort_cuda, ("ort", "onnx")),
    "emulate": (_emulate, ("trt",)),
    "trt": (_trt, ("trt", "onnx")),
}
# The backend a target runs on when none is named: one that works without a GPU.
DEFAULT_FOR_TARGET = {"ort": "ort-cpu", "onnx": "ort-cpu", "trt": "emulate"}


def default_backend(manifest: dict[str, Any]) -> str:
    return DEFAULT_FOR_TARGET.get(manifest["target"], "ort-cpu")


def _options_of(name: str) -> list[str]:
    factory_target = {"ort-cpu": "OrtBackend", "ort-cuda": "OrtBackend", "emulate": "EmulateBackend",
                      "trt": "TrtBackend"}[name]
    if name == "trt":
        from kvforge.runtime import trt_backend as module
    else:
        from kvforge.runtime import ort_backend as module
    params = inspect.signature(getattr(module, factory_target).__init__).parameters
    hidden = {"self", "folder", "manifest", "device"}
    return [p for p in params if p not in hidden]


def create_backend(name: str, folder: str | Path, manifest: dict[str, Any], **options: Any) -> Backend:
    """The backend `name` for an export folder, with its own keyword options (checked here)."""
    if name not in REGISTRY:
        raise InputError(f"unknown backend {name!r}; choose one of {', '.join(REGISTRY)}")
    factory, targets = REGISTRY[name]
    target = manifest["target"]
    if target not in targets:
        if target == "trt":
            raise InputError(
                f"{folder} is a trt-target export (its attention is kvforge's TensorRT plugin): run it with "
                "backend 'trt' (TensorRT engines from `kvforge build`) or 'emulate' (CPU emulation)"
            )
        runs = [n for n, (_, t) in REGISTRY.items() if target in t]
        raise InputError(f"backend {name!r} does not run {target}-target exports like {folder}; use one of {', '.join(runs)}")
    allowed = _options_of(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"backend {name!r} has no option {', '.join(unknown)}; its options are {', '.join(allowed)}")
    return factory(Path(folder), manifest, **options)
