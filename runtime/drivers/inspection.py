"""Looking inside a Generator's KV cache: where its buffers live, where a run wrote its outputs, what a
layer holds. For debugging and for the checks that the cache is written in place (the graphs' present_*
outputs land in the very buffers bound as past_*). The step path never calls these.

    kv_addresses(generator)                     # {"past_key.0": address, ...} of its latest request's cache
    bound_output_addresses(generator, "decode") # {"present_key.0": address, ...} its last decode run wrote to
    read_kv(generator, 0)                       # copies of layer 0's key and value buffers [B, H_kv, C, D]

Backends that can be looked into implement `Inspectable` (ort-cpu, ort-cuda, emulate, tensorrt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvforge.core.errors import InputError

if TYPE_CHECKING:
    from kvforge.runtime.drivers.generator import Generator


class Inspectable(Protocol):
    def kv_addresses(self, slot: Any) -> dict[str, int]: ...

    def bound_output_addresses(self, slot: Any, phase: str) -> dict[str, int]: ...

    def read_kv(self, slot: Any, layer: int) -> tuple[np.ndarray, np.ndarray]: ...


def _latest(generator: Generator, what: str) -> tuple[Any, Any]:
    backend = generator.backend
    if not callable(getattr(backend, what, None)):
        raise InputError(f"backend {backend.name!r} cannot be looked into ({what})")
    return backend, generator.slots.last


def kv_addresses(generator: Generator) -> dict[str, int]:
    """Address of every KV buffer of the latest request's cache, by graph input name ({} before any)."""
    backend, slot = _latest(generator, "kv_addresses")
    return backend.kv_addresses(slot) if slot is not None else {}


def bound_output_addresses(generator: Generator, phase: str) -> dict[str, int]:
    """Addresses the latest request's last `phase` run wrote its outputs to ({} before any)."""
    backend, slot = _latest(generator, "bound_output_addresses")
    return backend.bound_output_addresses(slot, phase) if slot is not None else {}


def read_kv(generator: Generator, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of layer `layer`'s key and value buffers of the latest request's cache."""
    backend, slot = _latest(generator, "read_kv")
    if slot is None:
        raise InputError("no KV cache yet: run generate() first")
    return backend.read_kv(slot, layer)
