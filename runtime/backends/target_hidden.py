"""The target's hidden states for a speculation head (contract.TARGET_HIDDEN): bound on ONNX Runtime slots.

With a head attached, the target's prefill and decode graphs also output `target_hidden` [B, S, Dt]. The
OrtBackend (runtime/backends/ort_backend.py) calls `before_run(backend, slot, phase)` right before each run, which
binds the output where the graph has it; `target_hidden(backend, slot)` hands back the slot's last run's rows:

    hidden = backend.target_hidden(slot)     # [B, S, Dt] host array, valid until the slot's next run

A prefill binds a fresh host array of its S (the way a verification's wide logits are bound); a decode step
binds one buffer per slot, once, at a fixed address (on ort-cuda a device buffer, so that a captured CUDA
graph writes the same memory at every replay; it is copied back only when asked for). The emulate and
tensorrt backends run no head: `target_hidden` refuses them with BackendUnavailableError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import TARGET_HIDDEN
from kvforge.core.errors import BackendUnavailableError, ManifestError
from kvforge.runtime.backends.ort_slot import device_array

HEAD_BACKENDS = ("ort-cpu", "ort-cuda")  # the backends that run a head (draft.onnx) beside the target
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def heads_refused(name: str) -> BackendUnavailableError:
    """The error for backend `name`, which runs no speculation head."""
    return BackendUnavailableError(
        f"backend {name!r} does not run speculation heads (EAGLE-3 / MTP, draft.onnx); use backend "
        f"{' or '.join(map(repr, HEAD_BACKENDS))}, or speculate with method 'draft' or 'prompt-lookup'")


def refuse_heads(backend: Any) -> None:
    """BackendUnavailableError unless `backend` can hand a speculation head its target's hidden states."""
    name = getattr(backend, "name", type(backend).__name__)
    if name not in HEAD_BACKENDS:
        raise heads_refused(name)


@dataclass
class HiddenSlot:
    """One slot's hidden-state output: the decode step's fixed buffer and what the last run wrote."""

    decode: np.ndarray | None = None  # [B, 1, Dt] host buffer (ort-cpu), bound once
    device: ort.OrtValue | None = None  # [B, 1, Dt] device buffer (ort-cuda), bound once
    last: np.ndarray | None = None  # the last run's host rows, None after a device decode step
    last_phase: str | None = None
    bound: set[str] = field(default_factory=set)  # phases whose binding holds the decode buffer


class HiddenOutputs:
    """Which of a backend's phases output TARGET_HIDDEN, its dtype and width, and the per-slot binding."""

    def __init__(self, phases: dict[str, tuple[Any, int]]) -> None:
        self.phases = phases  # phase -> (numpy dtype, Dt)

    @classmethod
    def of(cls, sessions: dict[str, ort.InferenceSession]) -> HiddenOutputs:
        phases = {}
        for phase, session in sessions.items():
            node = next((o for o in session.get_outputs() if o.name == TARGET_HIDDEN), None)
            if node is None:
                continue
            width = node.shape[-1] if node.shape else None
            if node.type not in _NUMPY or not isinstance(width, int) or width < 1:
                raise ManifestError(f"the {phase} graph's {TARGET_HIDDEN} is {node.type} of shape {node.shape}, not "
                                    "float [batch, seq, hidden]; re-run the export")
            phases[phase] = (_NUMPY[node.type], width)
        if phases and set(phases) != set(sessions):
            raise ManifestError(f"only the {', '.join(phases)} graph outputs {TARGET_HIDDEN}; a head needs both "
                                "phases' hidden states: re-run the export")
        return cls(phases)

    @property
    def width(self) -> int | None:
        """Dt, or None where the graphs output no hidden states."""
        return next(iter(self.phases.values()))[1] if self.phases else None


def outputs_of(backend: Any) -> HiddenOutputs:
    """The backend's HiddenOutputs, read from its sessions once (kept on the backend)."""
    hidden = getattr(backend, "hidden_outputs", None)
    if hidden is None:
        hidden = backend.hidden_outputs = HiddenOutputs.of(backend.sessions)
    return hidden


def before_run(backend: Any, slot: Any, phase: str) -> None:
    """Bind `slot`'s hidden-state output of `phase` for the run about to start (no-op without one)."""
    phases = outputs_of(backend).phases
    if phase not in phases:
        return
    dtype, width = phases[phase]
    state: HiddenSlot | None = getattr(slot, "hidden_state", None)
    if state is None:
        state = slot.hidden_state = HiddenSlot()
    binding = slot.bindings[phase]
    if phase == "prefill":
        # Its S is the bound input_ids'; a fresh array per prefill (it is handed back to the caller).
        rows = np.empty((slot.cache.batch, slot.prefill_inputs[0].shape[1], width), dtype=dtype)
        binding.bind_ortvalue_output(TARGET_HIDDEN, ort.OrtValue.ortvalue_from_numpy(rows))
        state.last, state.last_phase = rows, phase
        return
    if phase not in state.bound:
        shape = (slot.cache.batch, 1, width)
        if backend.on_device:
            state.device = device_array(backend.device, backend.device_id, np.zeros(shape, dtype))
            binding.bind_ortvalue_output(TARGET_HIDDEN, state.device)
        else:
            state.decode = np.zeros(shape, dtype)
            binding.bind_ortvalue_output(TARGET_HIDDEN, ort.OrtValue.ortvalue_from_numpy(state.decode))
        state.bound.add(phase)
    state.last, state.last_phase = state.decode, phase


def target_hidden(backend: Any, slot: Any) -> np.ndarray:
    """[B, S, Dt] hidden states of `slot`'s last prefill or decode run (a host array, valid until the slot's next
    run). BackendUnavailableError on a backend that runs no head, ManifestError for an export without them."""
    refuse_heads(backend)
    if not outputs_of(backend).phases:
        raise ManifestError(f"{backend.folder}'s graphs output no {TARGET_HIDDEN}: it was exported without a "
                            "speculation head; re-export it with one")
    state: HiddenSlot | None = getattr(slot, "hidden_state", None)
    if state is None or state.last_phase is None:
        raise ValueError("the slot has not run yet: target_hidden is the last prefill or decode run's")
    if state.last_phase != "prefill" and state.device is not None:
        with backend._device_lock:
            return state.device.numpy().reshape(slot.cache.batch, 1, -1)
    assert state.last is not None
    return state.last
