"""ONNX Runtime backends (ort-cpu, ort-cuda, emulate): sessions per phase, IO binding over KV caches.

Every `past_*` input and its `present_*` output are bound to the very same OrtValue, so the fused
attention node writes the new rows in place (ORT's GroupQueryAttention compares the pointers).
The backend's sessions are shared; the per-request state lives in an `OrtSlot` (a KV cache plus its
IO bindings, logits buffer and decode inputs), so several slots can run at once from different
threads: ONNX Runtime allows concurrent `run` calls on one session, each with its own binding.
A slot is bound once; a decode step writes into its numpy arrays and runs, nothing is rebound.

On a CUDA device (ort-cuda) the step's inputs live in device buffers too. ONNX Runtime copies an input bound on one
device to the device the graph reads it on once, when it is bound, not at every run; so a host `past_lens` or token
array bound once was read at its bind-time values forever (decode ran every step at position 0 with token 0: wrong
tokens from the second one on, measured on an H200), and so was a device `past_lens` that the prefill graph reads on
the CPU (a continuation prefill ran at past_lens 0, measured on an H100). Each run uploads `past_lens` (and a decode
step's token ids) into the slot's device buffers, one small copy each, and binds them again (the same addresses);
the decode step's logits come back from a device buffer. With every decode input and output at a fixed device
address, the decode step is captured once per slot as a CUDA graph (ONNX Runtime's `enable_cuda_graph`, one
`gpu_graph_id` per slot) and replayed after.
"""

from __future__ import annotations

import functools
import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import (
    IMAGE_FEATURES,
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    LOGITS_POSITIONS,
    PAST_LENS,
    POSITION_IDS,
    ROPE_DELTAS,
    GraphIO,
    KVLayout,
    ModelSpec,
    cache_output,
)
from kvforge.core.errors import InputError, KvforgeError, ManifestError
from kvforge.core.targets import Target
from kvforge.runtime.backends.backend import Limits, export_target
from kvforge.runtime.backends.device_pick import PICK_DTYPES, DevicePicker
from kvforge.runtime.backends.kv_cache import KVCache
from kvforge.runtime.backends.ort_sessions import (
    _QUIET_RUN,
    check_device,
    check_options,
    check_session_io,
    feature_dtype,
    logits_dtype,
    one_line,
    open_session,
    providers_for,
)
from kvforge.runtime.backends.ort_slot import OrtSlot, bind_buffer, device_array
from kvforge.runtime.backends.row_view import row_view
from kvforge.runtime.backends.target_hidden import before_run, target_hidden

# ort-cuda's decode attention (`decode_attention`): "auto", ONNX Runtime's choice (cuDNN's SDPA on compute capability
# >= 9.0, after a kernel that rotates and appends the new rows), the default; or "flash": flash attention first (rotation
# and append inside its kernel), then memory-efficient and unfused. On an H100 "flash" was the slower (SmolLM2-135M
# shape, fp16, batch 1: a replayed decode step 1.42 vs 1.11 ms; benchmarks/README.md). `sdpa_kernel` bits: flash 1,
# efficient 2, math 16.
DECODE_ATTENTION = ("auto", "flash")
SDPA_FLASH_FIRST = 1 | 2 | 16


class OrtBackend:
    """The prefill and decode sessions of one export folder (backends ort-cpu and ort-cuda).

    Options: `threads` (intra-op threads), `sessions` ("single": the prefill graph also runs the
    decode steps, one weight copy, ORT prepacks it, the default; "shared": prefill.onnx and decode.onnx over one
    memory-mapped copy, prepacking off (on a GPU each session uploads its own copy, so "single" holds the weights
    once there too); "separate": two sessions, two copies), `device_id`, `max_capacity` (allocate at most this many
    positions), `spinning` (ONNX Runtime's intra-op threads busy-wait for work between ops, its default; False makes
    them sleep: on a CPU that other busy processes share, a spinning thread holds a core the thread with work needs;
    see benchmarks/README.md, "Op-level decode profile"), `cuda_graphs` (ort-cuda: capture each slot's decode step
    as a CUDA graph and replay it; on by default, needs decode.onnx's own session, so "separate" sessions, the
    default on a GPU, where "shared" is the same and "single" runs decode steps through the prefill graph, which
    copies a length to the host mid-graph)."""

    custom_ops_library: str | None = None  # registered on every session (the emulation's plugin op)
    # Tests: run the device code path (device buffers, uploads, row copies through kvforge.core.cuda) on
    # ONNX Runtime CPU, whose "device" memory is host memory (tests/runtime/test_device_path.py).
    simulate_device = False
    # (slot) -> [B, S, Dt] of its last run (a speculation head's input); (slot, at) -> a batch-1 slot over row `at`
    target_hidden, row_view = target_hidden, row_view

    def __init__(
        self,
        folder: str | Path,
        manifest: dict[str, Any],
        device: str = "cpu",
        device_id: int = 0,
        threads: int | None = None,
        sessions: str | None = None,
        max_capacity: int | None = None,
        spinning: bool = True,
        cuda_graphs: bool | None = None,
        device_greedy: bool | None = None,
        decode_attention: str = "auto",
        target: Target | None = None,
    ) -> None:
        self.name = {"cpu": "ort-cpu", "cuda": "ort-cuda"}.get(device, device)
        target = export_target(manifest, target)  # handed in by a LoadedExport (create_backend), which resolved it
        self.kv = KVLayout.from_manifest(manifest)
        self.folder, self.manifest, self.device, self.device_id = Path(folder), manifest, device, device_id
        self.num_layers = self.kv.num_layers
        self.on_device = device != "cpu" or self.simulate_device
        sessions = sessions if sessions is not None else ("separate" if self.on_device else "single")
        check_device(self.folder, self.manifest, target, self.kv, self.device, self.device_id, cuda_graphs, sessions)
        check_options(threads, spinning, sessions, max_capacity)
        providers = providers_for(device, device_id)
        self.cuda_graphs = device != "cpu" and sessions != "single" and cuda_graphs is not False
        self.cuda_graphs_refused: str | None = None  # ONNX Runtime's reason, where it would not capture
        # ort-cuda: runs, uploads and row copies take turns (a CUDA graph capture must not see other work).
        self._device_lock = threading.Lock()
        self._graph_ids = itertools.count(1)
        self.session_mode = sessions
        if decode_attention not in DECODE_ATTENTION:
            raise InputError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        self.sessions: dict[str, ort.InferenceSession] = {}
        opening = dict(device=device, threads=threads, spinning=spinning, sessions=sessions,
                       custom_ops_library=self.custom_ops_library)
        for phase in ("prefill", "decode"):
            if sessions == "single" and phase == "decode":
                # The prefill graph takes any S, so S=1 is a decode step: one session, one copy of
                # the weights, and ORT may prepack them (its CPU matmuls are faster packed).
                self.sessions["decode"] = self.sessions["prefill"]
                continue
            self.sessions[phase] = self._open(phase, providers, cuda_graphs, opening)
            check_session_io(manifest, self.kv, phase, self.sessions[phase])
        self.logits_dtype = logits_dtype(manifest)
        self.vocab_size = ModelSpec.from_manifest(manifest).vocab_size
        # A vision-language export's prefill graph takes image features: none ([0, hidden]) unless a prefill has some.
        self.no_features = None if manifest.get("vision") is None else \
            np.zeros((0, manifest["vision"]["hidden_size"]), feature_dtype(manifest))
        # An M-RoPE export: prefill takes each token's three positions, decode the rows' offsets (contract).
        self.mrope = POSITION_IDS in GraphIO.of_manifest("prefill", self.kv, manifest).inputs
        self.runs = {"prefill": 0, "decode": 0}
        self.allocations = 0
        self._runs_lock = threading.Lock()
        self.limits = Limits.from_manifest(manifest, target, max_capacity=max_capacity)
        if device_greedy is not None and not isinstance(device_greedy, bool):
            raise InputError(f"device_greedy must be True or False, got {device_greedy!r}")
        if device_greedy and not self.on_device:
            raise InputError("device_greedy is an option of backend 'ort-cuda' (greedy picks on the GPU)")
        # The pick reads the decode graph's [B, V] logits buffer: decode.onnx's own session, a dtype numpy has.
        self.picker: DevicePicker | None = None
        if (self.on_device and device_greedy is not False and sessions != "single"
                and np.dtype(self.logits_dtype) in PICK_DTYPES):
            self.picker = DevicePicker(np.dtype(self.logits_dtype), device, device_id, cuda_graphs=self.cuda_graphs)
        self.device_greedy = self.picker is not None
        self.device_greedy_refused: str | None = None  # why the pick graph stopped running, where it did

    def _open(self, phase: str, providers: list[Any], cuda_graphs: bool | None,
              opening: dict[str, Any]) -> ort.InferenceSession:
        file = self.folder / self.manifest["graphs"][phase]["file"]
        graphs = self.cuda_graphs and phase == "decode"
        if self.device == "cuda" and phase == "decode" and self.session_mode != "single":
            providers = self._decode_providers(graphs)
        try:
            return open_session(self.folder, self.manifest, phase, providers, **opening)
        except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph types
            if not (graphs and cuda_graphs is None):
                raise ManifestError(f"ONNX Runtime could not load {file}: {one_line(err)}; re-run the export") from err
            # CUDA graphs were the default, not asked for: a graph ONNX Runtime will not capture (a node it
            # keeps on the CPU) still runs, step by step; its reason is kept.
            self.cuda_graphs, self.cuda_graphs_refused = False, one_line(err)
        return open_session(self.folder, self.manifest, phase, self._decode_providers(False), **opening)

    def _decode_providers(self, graphs: bool) -> list[Any]:
        """The decode session's CUDA provider: its CUDA graph, and the attention kernels its
        GroupQueryAttention may pick (`decode_attention`)."""
        options: dict[str, str] = {"device_id": str(self.device_id)}
        if graphs:
            options["enable_cuda_graph"] = "1"
        if self.decode_attention == "flash":
            options["sdpa_kernel"] = str(SDPA_FLASH_FIRST)
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

    # -- the backend protocol (runtime/backends/backend.py) -----------------------------------------------
    def allocate(self, batch: int, capacity: int) -> OrtSlot:
        """A KV cache of this shape on the backend's device, bound to both phases in place."""
        cache = KVCache.from_manifest(self.manifest, batch, capacity, device=self.device, device_id=self.device_id,
                                      on_device=self.on_device)
        cache.max_capacity = self.limits.max_capacity
        with self._runs_lock:
            self.allocations += 1
        return self.bind(cache)

    def prefill(self, slot: OrtSlot, input_ids: np.ndarray, logits_index: np.ndarray,
                image_features: np.ndarray | None = None, positions: np.ndarray | None = None) -> np.ndarray:
        return self.run_prefill(slot, input_ids, logits_index, image_features, positions)

    def decode(self, slot: OrtSlot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray:
        return self.run_decode(slot, token_ids, running)

    def kv_addresses(self, slot: OrtSlot) -> dict[str, int]:
        return slot.cache.addresses()

    def read_kv(self, slot: OrtSlot, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return slot.cache.read(layer)

    # -- binding --------------------------------------------------------------------------------
    def bind(self, cache: KVCache) -> OrtSlot:
        """Bind `cache` (and fresh logits / decode-input buffers sized for its batch) to both phases.
        Called once per cache; every later run on the returned slot reuses these bindings."""
        batch = cache.batch
        slot = OrtSlot(
            cache=cache, bindings={}, output_order={},
            logits=np.zeros((batch, self.vocab_size), dtype=self.logits_dtype),
            decode_ids=np.zeros((batch, 1), dtype=np.int64),
            decode_index=np.zeros((batch, 1), dtype=np.int64),
        )
        # The OrtValues wrap these arrays, so a decode step only writes numpy. The prefill graph
        # returns logits per selected position, [B, K, V]; with K = 1 that is the same memory as the
        # decode graph's [B, V], so one buffer serves both.
        # Keyed by the IO name each value is bound to (decode's own inputs have their own keys).
        slot.host_values = {
            "decode_ids": ort.OrtValue.ortvalue_from_numpy(slot.decode_ids),
            PAST_LENS: ort.OrtValue.ortvalue_from_numpy(cache.past_lens),
            LOGITS: ort.OrtValue.ortvalue_from_numpy(slot.logits),
            LOGITS_POSITIONS: ort.OrtValue.ortvalue_from_numpy(slot.logits.reshape(batch, 1, self.vocab_size)),
            "decode_index": ort.OrtValue.ortvalue_from_numpy(slot.decode_index),
        }
        if self.mrope:
            slot.host_values[ROPE_DELTAS] = ort.OrtValue.ortvalue_from_numpy(cache.rope_deltas)
        inputs = slot.host_values
        if self.on_device:
            single = self.session_mode == "single"
            on = functools.partial(device_array, self.device, self.device_id)
            logits_shape = (batch, 1, self.vocab_size) if single else (batch, self.vocab_size)
            slot.device_values = {PAST_LENS: on(np.zeros(batch, np.int32)), "decode_ids": on(slot.decode_ids),
                                  "decode_index": on(slot.decode_index),
                                  LOGITS: on(np.zeros(logits_shape, self.logits_dtype))}
            if self.mrope:
                slot.device_values[ROPE_DELTAS] = on(cache.rope_deltas)
            inputs = slot.device_values
            slot.decode_options = self._decode_run_options()
            if self.picker is not None:
                slot.pick = self.picker.bind(slot.device_values[LOGITS], batch)
        for phase, session in self.sessions.items():
            binding = session.io_binding()
            order: list[str] = []
            binding.bind_ortvalue_input(PAST_LENS, inputs[PAST_LENS])
            if phase == "decode":
                binding.bind_ortvalue_input(INPUT_IDS, inputs["decode_ids"])
                if self.session_mode == "single":
                    binding.bind_ortvalue_input(LOGITS_INDEX, inputs["decode_index"])
                elif self.mrope:
                    binding.bind_ortvalue_input(ROPE_DELTAS, inputs[ROPE_DELTAS])
            per_position = phase == "prefill" or self.session_mode == "single"  # the prefill graph runs
            if per_position and self.no_features is not None:
                binding.bind_cpu_input(IMAGE_FEATURES, self.no_features)
            if self.on_device and phase == "decode":
                binding.bind_ortvalue_output(LOGITS, slot.device_values[LOGITS])
            else:  # prefill: into the host buffer (ONNX Runtime copies device outputs there after the run)
                binding.bind_ortvalue_output(LOGITS, slot.host_values[LOGITS_POSITIONS if per_position else LOGITS])
            order.append(LOGITS)
            for layer, kind in self.kv.buffers():
                bind_buffer(binding, cache, layer, kind, self.device, self.device_id)
                order.append(cache_output(kind, layer))
            slot.bindings[phase] = binding
            slot.output_order[phase] = order
        return slot

    def _decode_run_options(self) -> ort.RunOptions:
        """Decode runs' options: quiet, and with CUDA graphs the slot's own graph id (its buffers differ
        from every other slot's, so it is captured on its own)."""
        options = ort.RunOptions()
        options.log_severity_level = 4
        options.add_run_config_entry("gpu_graph_id", str(next(self._graph_ids)) if self.cuda_graphs else "-1")
        return options

    def bind_rows(self, slot: OrtSlot, rows: int) -> OrtSlot:
        """A slot that runs only the first `rows` rows of `slot`'s cache: the same KV memory and
        `past_lens` (KVCache.first_rows), its own bindings and logits buffer. A step on it writes its
        rows in place and leaves the others untouched (the serving scheduler's batch buckets)."""
        if self.on_device and slot.cache.dtype == "bfloat16" and rows < slot.cache.batch:
            raise InputError("a bf16 cache on the GPU has no row views (numpy has no bfloat16 to bind them with)")
        return self.bind(slot.cache.first_rows(rows))

    # -- row operations (runtime/backends/backend.py) -----------------------------------------------------
    def view_rows(self, slot: OrtSlot, rows: int) -> OrtSlot | None:
        """bind_rows, or None where the cache cannot be viewed (then callers run the whole batch)."""
        if self.on_device and slot.cache.dtype == "bfloat16" and rows < slot.cache.batch:
            return None
        return self.bind_rows(slot, rows)

    def copy_rows(self, src: OrtSlot, row: int, dst: OrtSlot, dst_row: int, positions: int) -> None:
        with self._device_lock:
            src.cache.copy_rows(row, dst.cache, dst_row, positions)

    def read_rows(self, slot: OrtSlot, row: int, positions: int) -> list[tuple[np.ndarray, np.ndarray]]:
        with self._device_lock:
            return slot.cache.read_rows(row, positions)

    def write_rows(self, slot: OrtSlot, row: int, layers: list[tuple[np.ndarray, np.ndarray]], positions: int) -> None:
        with self._device_lock:
            slot.cache.write_rows(row, layers, positions)

    # -- running --------------------------------------------------------------------------------
    def run_prefill(self, slot: OrtSlot, input_ids: np.ndarray, logits_index: np.ndarray,
                    image_features: np.ndarray | None = None, positions: np.ndarray | None = None) -> np.ndarray:
        """input_ids [B, S] int64 (right-padded); logits_index [B] -> logits [B, V] float32, or
        [B, K] (K positions per row, e.g. to verify speculative drafts) -> logits [B, K, V].
        Writes positions past_lens[b] + 0..S-1 of every row; the caller advances past_lens. `image_features`: a
        vision-language export's, one row per image token of `input_ids`, row-major (contract.IMAGE_FEATURES).
        `positions`: an M-RoPE export's [3, B, S] (contract.POSITION_IDS); None: a text call's
        (CacheState.text_positions)."""
        slot.cache.check_fits(input_ids.shape[1])
        binding = slot.bindings["prefill"]
        index = np.ascontiguousarray(logits_index, dtype=np.int64)
        per_row = index.ndim == 1
        index = index.reshape(index.shape[0], -1)
        # Prefill runs once per request (or per verification), so binding fresh arrays costs little.
        slot.prefill_inputs = (np.ascontiguousarray(input_ids, dtype=np.int64), index)
        binding.bind_cpu_input(INPUT_IDS, slot.prefill_inputs[0])
        binding.bind_cpu_input(LOGITS_INDEX, index)
        if self.no_features is not None:
            features = np.ascontiguousarray(self.no_features if image_features is None else image_features,
                                            dtype=self.no_features.dtype)
            slot.prefill_inputs += (features,)
            binding.bind_cpu_input(IMAGE_FEATURES, features)
        if self.mrope:
            given = slot.cache.text_positions(input_ids.shape[1]) if positions is None else \
                np.ascontiguousarray(positions, dtype=np.int64)
            slot.prefill_inputs += (given,)
            binding.bind_cpu_input(POSITION_IDS, given)
        elif positions is not None:
            raise InputError("positions are an input of an export with multimodal rotary positions (M-RoPE) only")
        if index.shape[1] == 1:
            binding.bind_ortvalue_output(LOGITS, slot.host_values[LOGITS_POSITIONS])
            logits = self._run(slot, "prefill")
            return logits if per_row else logits.reshape(index.shape[0], 1, self.vocab_size)
        wide = np.empty((index.shape[0], index.shape[1], self.vocab_size), dtype=self.logits_dtype)
        binding.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(wide))
        self._run(slot, "prefill")
        return wide.astype(np.float32, copy=False)

    def run_decode(self, slot: OrtSlot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray:
        """token_ids [B] -> logits [B, V] float32. Writes position past_lens[b] of every row; the
        capacity is checked for the `running` rows only (finished rows are frozen by the caller)."""
        slot.cache.check_fits(1, running)
        slot.decode_ids[:, 0] = token_ids
        self._bind_decode_positions(slot)
        return self._run(slot, "decode")

    def _bind_decode_positions(self, slot: OrtSlot) -> None:
        """An M-RoPE export's decode step through the prefill graph (session mode "single"): the new token's
        positions, past_lens + rope_deltas (decode.onnx computes them itself from contract.ROPE_DELTAS)."""
        if self.mrope and self.session_mode == "single":
            slot.decode_positions = slot.cache.text_positions(1)
            slot.bindings["decode"].bind_cpu_input(POSITION_IDS, slot.decode_positions)

    def decode_greedy(self, slot: OrtSlot, token_ids: np.ndarray,
                      running: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A decode step whose tokens are picked on the device (device_greedy): token_ids [B] -> (each
        row's argmax [B] int64, each row's logits summed [B, 1], NaN where the row holds a NaN). The
        logits stay in the device buffer."""
        slot.cache.check_fits(1, running)
        slot.decode_ids[:, 0] = token_ids
        self._bind_decode_positions(slot)
        with self._device_lock:
            self._run_on_device(slot, "decode", logits_back=False)
            if self.picker is not None:
                try:
                    token, total = self.picker.run(slot.pick)
                    return token, total.reshape(-1, 1)
                except Exception as err:  # ONNX Runtime's own types: pick on the host from now on, say why
                    self.picker, self.device_greedy_refused = None, one_line(err)
            logits = self._decode_logits(slot)
        return logits.argmax(-1), logits.sum(-1, keepdims=True)

    def _run(self, slot: OrtSlot, phase: str) -> np.ndarray:
        if self.on_device:
            with self._device_lock:
                return self._run_on_device(slot, phase)
        self._session_run(slot, phase, _QUIET_RUN)
        # float32 logits are returned as a view of the slot's buffer: valid until its next run.
        return slot.logits if slot.logits.dtype == np.float32 else slot.logits.astype(np.float32)

    def _run_on_device(self, slot: OrtSlot, phase: str, logits_back: bool = True) -> np.ndarray | None:
        """Upload the step's inputs into the slot's device buffers (bound once, at fixed addresses),
        run, and copy the logits back: the decode step's from its device buffer, prefill's ONNX Runtime
        copies into the host buffer bound as its output."""
        values = slot.device_values
        binding = slot.bindings[phase]
        values[PAST_LENS].update_inplace(slot.cache.past_lens)
        # Bound again (the same OrtValue, so the same address a CUDA graph replays): where a graph reads
        # an input on the CPU (the prefill graph's length arithmetic reads past_lens there), ONNX Runtime
        # copies the device value to the host when it is bound, and a value bound once would stay at its
        # first contents. Where the graph reads it on the device, binding again copies nothing.
        binding.bind_ortvalue_input(PAST_LENS, values[PAST_LENS])
        if phase == "decode":
            values["decode_ids"].update_inplace(slot.decode_ids)
            binding.bind_ortvalue_input(INPUT_IDS, values["decode_ids"])
            if self.mrope and self.session_mode != "single":  # bound again for the reason past_lens is
                values[ROPE_DELTAS].update_inplace(slot.cache.rope_deltas)
                binding.bind_ortvalue_input(ROPE_DELTAS, values[ROPE_DELTAS])
        binding.synchronize_inputs()
        self._session_run(slot, phase, slot.decode_options if phase == "decode" else _QUIET_RUN)
        binding.synchronize_outputs()
        if not logits_back:
            return None
        if phase == "decode":
            return self._decode_logits(slot)
        return slot.logits if slot.logits.dtype == np.float32 else slot.logits.astype(np.float32)

    def _decode_logits(self, slot: OrtSlot) -> np.ndarray:
        """The last decode step's logits, copied back from the slot's device buffer, [B, V] float32."""
        logits = slot.device_values[LOGITS].numpy().reshape(slot.cache.batch, self.vocab_size)
        return logits.astype(np.float32, copy=False)

    def _session_run(self, slot: OrtSlot, phase: str, options: ort.RunOptions) -> None:
        before_run(self, slot, phase)  # binds a speculation head's target_hidden output, where the graph has one
        try:
            self.sessions[phase].run_with_iobinding(slot.bindings[phase], options)
        except Exception as err:  # ORT's own exception types; say which graph and why, on one line
            raise KvforgeError(f"ONNX Runtime failed running the {phase} graph of {self.folder}: {one_line(err)}") from err
        with self._runs_lock:
            self.runs[phase] += 1

    def bound_output_addresses(self, slot: OrtSlot, phase: str) -> dict[str, int]:
        """Addresses of the outputs the last run of `phase` on `slot` wrote to, by output name.
        get_outputs() returns outputs in binding order, not graph order, hence the recorded order."""
        outputs = slot.bindings[phase].get_outputs()
        return {name: value.data_ptr() for name, value in zip(slot.output_order[phase], outputs, strict=True)}
