"""The runtime's one seam: a backend runs an export's prefill and decode over KV caches it owns.

    backend = create_backend("ort-cpu", folder, manifest, threads=2)   # or "ort-cuda", "emulate", "tensorrt"
    slot = backend.allocate(batch, capacity)      # KV cache on the backend's device, bound in place
    logits = backend.prefill(slot, input_ids, logits_index)   # [B, V] float32 on the host
    logits = backend.decode(slot, token_ids, running)         # one token per row
    backend.copy_rows(slot, 3, other, 0, n)       # rows move on the backend's device (serving)
    backend.limits                                # the batch / capacity it was built for

A slot is what one request runs on: the cache buffers (bound as both past_* and present_*), their
bindings, and `slot.cache`, the host-side state the Generator advances (`past_lens`, capacity
checks). `Generator` knows only this protocol; backend options (ONNX Runtime's session mode and
threads, TensorRT's engine folder) are the backend's keyword arguments.

Row operations (copy_rows, read_rows / write_rows for the prefix store, view_rows for batch
buckets) are what the serving scheduler needs: it never touches a buffer itself, so it serves on
every backend that has them (`supports_rows`).

Adding a backend: an entry in REGISTRY (its class, given lazily as "module:Class", and the export
targets it runs) plus its own module. Backend names never equal a target's name.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvforge.core.contract import KVLayout, capacity_buckets
from kvforge.core.errors import InputError
from kvforge.core.targets import TARGETS, Target, get_target

if TYPE_CHECKING:  # the registry is read by the CLI without loading ONNX Runtime
    from kvforge.runtime.backends.kv_cache import CacheState


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
    # Whether a run's extra positions can be taken back (speculation drops rejected drafts by not counting
    # them): not where a layer keeps a recurrent state, which every token fed advances for good.
    rollback: bool = True

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], target: Target, max_batch: int | None = None,
                      max_capacity: int | None = None) -> Limits:
        """The limits of `manifest`'s export, whose target is `target` (resolved once, by its loader)."""
        layout = KVLayout.from_manifest(manifest)
        cap = layout.max_capacity
        if max_capacity is not None:
            cap = min(cap, int(max_capacity))
        return cls(max_batch, cap, capacity_buckets(cap), target.continue_batch, rollback=not layout.states)

    def check_speculation(self, speculation: Any) -> None:
        """InputError for a speculative request on a cache that cannot roll back rejected drafts."""
        if speculation is not None and not self.rollback:
            raise InputError("speculative decoding needs a cache that can drop rejected drafts, and this model's "
                             "recurrent layers keep a state that every token advances for good; generate without "
                             "speculation")


class Slot(Protocol):
    cache: CacheState


class Backend(Protocol):
    name: str
    limits: Limits
    runs: dict[str, int]  # graph runs per phase since load
    allocations: int  # KV caches allocated since load

    def allocate(self, batch: int, capacity: int) -> Slot: ...

    # image_features: a vision-language export's (contract.IMAGE_FEATURES), None for none; positions: an M-RoPE
    # export's [3, B, S] (contract.POSITION_IDS), None for a text call; a backend that runs no such export refuses any.
    def prefill(self, slot: Slot, input_ids: np.ndarray, logits_index: np.ndarray,
                image_features: np.ndarray | None = None, positions: np.ndarray | None = None) -> np.ndarray: ...

    def decode(self, slot: Slot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray: ...

    # Row operations (serving: runtime/drivers/scheduler.py). A row's positions 0..positions-1, every layer.
    def copy_rows(self, src: Slot, row: int, dst: Slot, dst_row: int, positions: int) -> None: ...

    def read_rows(self, slot: Slot, row: int, positions: int) -> list[tuple[np.ndarray, ...]]: ...

    def write_rows(self, slot: Slot, row: int, layers: list[tuple[np.ndarray, ...]], positions: int) -> None: ...

    def view_rows(self, slot: Slot, rows: int) -> Slot | None: ...  # the first `rows` rows, in place



@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: its class ("module:Class", imported when first used, so that naming a
    backend never imports another's stack), fixed keyword arguments, and the targets it runs."""

    cls: str
    targets: tuple[str, ...]
    fixed: dict[str, Any] = field(default_factory=dict)

    def load(self) -> type:
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)

    def options(self) -> list[str]:
        """The keyword options a caller may give (the class's, less the ones every backend gets)."""
        hidden = {"self", "folder", "manifest", "target", *self.fixed}
        return [p for p in inspect.signature(self.load().__init__).parameters if p not in hidden]


REGISTRY: dict[str, BackendEntry] = {
    "ort-cpu": BackendEntry("kvforge.runtime.backends.ort_backend:OrtBackend", ("ort", "onnx"), {"device": "cpu"}),
    "ort-cuda": BackendEntry("kvforge.runtime.backends.ort_backend:OrtBackend", ("ort", "onnx"), {"device": "cuda"}),
    "emulate": BackendEntry("kvforge.runtime.backends.emulate:EmulateBackend", ("trt",)),
    "tensorrt": BackendEntry("kvforge.runtime.backends.trt_backend:TrtBackend", ("trt", "onnx")),
}
# Earlier names, refused with the new one (a backend's name never equals a target's).
RENAMED = {"trt": "tensorrt"}
assert not set(REGISTRY) & set(TARGETS), "a backend and a target share a name"


ROW_OPERATIONS = ("copy_rows", "read_rows", "write_rows", "view_rows")


def supports_rows(backend: Any) -> bool:
    """Whether `backend` has the row operations serving needs."""
    return all(callable(getattr(backend, name, None)) for name in ROW_OPERATIONS)


def export_target(manifest: dict[str, Any], target: Target | None = None) -> Target:
    """`target` as handed in (a LoadedExport's, resolved once when it read the manifest), else the manifest's own:
    a backend or head built straight from a manifest dict (create_backend's documented form, tests, benchmarks)
    is the first to read it."""
    return target if target is not None else get_target(manifest["target"])


def create_backend(name: str, folder: str | Path, manifest: dict[str, Any], *, target: Target | None = None,
                   **options: Any) -> Backend:
    """The backend `name` for an export folder, with its own keyword options (checked here). `target`: the
    manifest's, where the caller resolved it already (LoadedExport.target)."""
    if name in RENAMED:
        raise InputError(f"backend {name!r} is now called {RENAMED[name]!r}; use backend {RENAMED[name]!r}")
    if name not in REGISTRY:
        raise InputError(f"unknown backend {name!r}; choose one of {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    target = export_target(manifest, target)
    if target.name not in entry.targets:
        runs = [n for n, e in REGISTRY.items() if target.name in e.targets]
        what = f" (its attention is {target.summary})" if target.plugin is not None else ""
        raise InputError(
            f"backend {name!r} does not run {target.name}-target exports like {folder}{what}; use one of {', '.join(runs)}"
        )
    allowed = entry.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"backend {name!r} has no option {', '.join(unknown)}; its options are {', '.join(allowed)}")
    return entry.load()(Path(folder), manifest, **entry.fixed, **options, target=target)
