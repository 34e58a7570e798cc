"""ONNX Runtime backends (ort-cpu, ort-cuda, emulate): sessions per phase, IO binding over KV caches.

Every `past_*` input and its `present_*` output are bound to the very same OrtValue, so the fused
attention node writes the new rows in place (ORT's GroupQueryAttention compares the pointers).
The backend's sessions are shared; the per-request state lives in an `OrtSlot` (a KV cache plus its
IO bindings, logits buffer and decode inputs), so several slots can run at once from different
threads: ONNX Runtime allows concurrent `run` calls on one session, each with its own binding.
A slot is bound once; a decode step writes into its numpy arrays and runs, nothing is rebound.

On a CUDA device (ort-cuda) the step's inputs live in device buffers too. ONNX Runtime copies an
input bound on one device to the device the graph reads it on once, when it is bound, not at every
run; so a host `past_lens` or token array bound once was read at its bind-time values forever
(decode ran every step at position 0 with token 0: wrong tokens from the second one on, measured
on an H200), and so was a device `past_lens` that the prefill graph reads on the CPU (a
continuation prefill ran at past_lens 0, measured on an H100). Each run uploads `past_lens` (and a
decode step's token ids) into the slot's device buffers, one small copy each, and binds them again
(the same addresses); the decode step's logits come back from a device buffer. With every decode
input and output at a fixed device address, the decode step is captured once per slot as a CUDA
graph (ONNX Runtime's `enable_cuda_graph`, one `gpu_graph_id` per slot) and replayed after.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import (
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    LOGITS_POSITIONS,
    PAST_LENS,
    GraphIO,
    KVLayout,
    ModelSpec,
    cache_input,
    cache_output,
    parse_cache_name,
)
from kvforge.core.errors import BackendUnavailableError, InputError, KvforgeError, ManifestError
from kvforge.core.manifest import io_entry, io_names, read_graph
from kvforge.runtime.backend import Limits
from kvforge.runtime.kv_cache import KVCache

DEVICES = ("cpu", "cuda")
# "single": the prefill graph serves decode steps too (one session, one weight copy, prepacked);
# "shared": prefill.onnx + decode.onnx over one memory-mapped weight copy, prepacking off;
# "separate": prefill.onnx + decode.onnx, each session prepacks its own copy (two copies).
SESSION_MODES = ("single", "shared", "separate")
LOGITS_DTYPES = {"float32": np.float32, "float16": np.float16}
# ONNX Runtime optimisers left out on the CPU. ConstantFolding's only work on these graphs (checked on
# every recipe's export, fp32 and int8/int4) is a transposed copy of a tied lm_head's embedding (113 MB
# for SmolLM2-135M) at every session creation; without it the Transpose fuses into a FusedMatMul over
# the embedding itself: the same tokens and decode speed, a session built ~0.3 s sooner (peak RSS the
# same; benchmarks/README.md "Cold start").
CPU_DISABLED_OPTIMIZERS = ["ConstantFolding"]
_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
               "tensor(int32)": "int32", "tensor(bfloat16)": "bfloat16", "tensor(int8)": "int8"}


# ONNX Runtime logs a failed run on stderr itself (a raw, coloured line) before raising; the error
# is re-raised here as one line with the same text, so its own log of runs is turned off (FATAL only).
_QUIET_RUN = ort.RunOptions()
_QUIET_RUN.log_severity_level = 4
# ORT's Python run_with_iobinding looks this entry up on every run and, when it is absent, pays for a
# C++ exception turned into a Python one (~40 us a step, ~0.8% of a quiet int4 decode step here). "0" is the
# value an absent entry means (the default CUDA/WebGPU graph annotation), so behaviour is unchanged.
_QUIET_RUN.add_run_config_entry("gpu_graph_id", "0")


def providers_for(device: str, device_id: int = 0) -> list[Any]:
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise BackendUnavailableError(
                "backend 'ort-cuda' needs onnxruntime's CUDAExecutionProvider, but this onnxruntime offers "
                f"{available}; install onnxruntime-gpu (pip install 'kvforge[gpu]') or use backend='ort-cpu'"
            )
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    raise InputError(f"unknown ONNX Runtime device {device!r}; expected one of {DEVICES}")


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


class OrtBackend:
    """The prefill and decode sessions of one export folder (backends ort-cpu and ort-cuda).

    Options: `threads` (intra-op threads), `sessions` ("single": the prefill graph also runs the
    decode steps, one weight copy, ORT prepacks it, the default; "shared": prefill.onnx and
    decode.onnx over one memory-mapped copy, prepacking off (on a GPU each session uploads its own
    copy, so "single" holds the weights once there too); "separate": two sessions, two copies),
    `device_id`, `max_capacity` (allocate at most this many positions), `spinning` (ONNX Runtime's
    intra-op threads busy-wait for work between ops, its default; False makes them sleep: on a CPU
    that other busy processes share, a spinning thread holds a core the thread with work needs;
    see benchmarks/README.md, "Op-level decode profile"), `cuda_graphs` (ort-cuda: capture each slot's
    decode step as a CUDA graph and replay it; on by default, needs decode.onnx's own session, so
    "separate" sessions, the default on a GPU, where "shared" is the same and "single" runs decode
    steps through the prefill graph, which copies a length to the host mid-graph)."""

    custom_ops_library: str | None = None  # registered on every session (the emulation's plugin op)
    # Tests: run the device code path (device buffers, uploads, row copies through kvforge.core.cuda) on
    # ONNX Runtime CPU, whose "device" memory is host memory (tests/test_device_path.py).
    simulate_device = False

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
    ) -> None:
        self.name = {"cpu": "ort-cpu", "cuda": "ort-cuda"}.get(device, device)
        self.kv = KVLayout.from_manifest(manifest)
        if self.kv.dtype == "bfloat16" and device == "cpu":
            raise InputError(
                f"{folder} is a bf16 export: ONNX Runtime CPU has no bfloat16 kernels, so it cannot run here; "
                "use --backend ort-cuda, or export with --dtype fp16 or fp32"
            )
        self.on_device = device != "cpu" or self.simulate_device
        if sessions is None:
            sessions = "separate" if self.on_device else "single"
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise InputError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        if cuda_graphs and device == "cpu":
            raise InputError("cuda_graphs is an option of backend 'ort-cuda' (CUDA graphs need a GPU)")
        if cuda_graphs and sessions == "single":
            raise InputError("cuda_graphs needs decode.onnx in its own session: use sessions='separate' "
                             "('single' runs decode steps through the prefill graph, which cannot be captured)")
        self.cuda_graphs = device != "cpu" and sessions != "single" and cuda_graphs is not False
        self.cuda_graphs_refused: str | None = None  # ONNX Runtime's reason, where it would not capture
        # ort-cuda: runs, uploads and row copies take turns (a CUDA graph capture must not see other work).
        self._device_lock = threading.Lock()
        self._graph_ids = itertools.count(1)
        self.folder = Path(folder)
        self.manifest = manifest
        self.device = device
        self.device_id = device_id
        self.num_layers = self.kv.num_layers
        providers = providers_for(device, device_id)
        if device == "cuda" and manifest["target"] == "ort" and manifest.get("dtype") == "fp32":
            raise InputError(
                f"{folder} is an fp32 export of the ort target: ONNX Runtime's CUDA GroupQueryAttention has fp16 "
                "and bf16 kernels only (fp32 would run attention on the CPU, copying the cache every step); "
                "export with --dtype fp16 (or bf16) for --backend ort-cuda"
            )
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        if not isinstance(spinning, bool):
            raise InputError(f"spinning must be True or False, got {spinning!r}")
        if sessions not in SESSION_MODES:
            raise InputError(f"unknown sessions mode {sessions!r}; choose one of {', '.join(SESSION_MODES)}")
        self.session_mode = sessions
        self.sessions: dict[str, ort.InferenceSession] = {}
        for phase in ("prefill", "decode"):
            phase_providers = providers
            if self.cuda_graphs and phase == "decode":
                phase_providers = [("CUDAExecutionProvider", {"device_id": device_id, "enable_cuda_graph": "1"}),
                                   "CPUExecutionProvider"]
            if sessions == "single" and phase == "decode":
                # The prefill graph takes any S, so S=1 is a decode step: one session, one copy of
                # the weights, and ORT may prepack them (its CPU matmuls are faster packed).
                self.sessions["decode"] = self.sessions["prefill"]
                continue
            options = ort.SessionOptions()
            if self.custom_ops_library is not None:
                options.register_custom_ops_library(self.custom_ops_library)
            if threads is not None:
                options.intra_op_num_threads = threads
            if not spinning:
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if sessions == "shared":
                # ORT memory-maps the external weights file, so both sessions read the same page-cache
                # copy. The CPU kernels' prepacking would make a private packed copy per session (two
                # copies of the weights); turning it off keeps one, at some decode speed.
                options.add_session_config_entry("session.disable_prepacking", "1")
            # The graph is loaded from the bytes that were checked against the manifest's sha256;
            # its external weights are resolved in the export folder (ORT refuses paths leaving it).
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.folder))
            graph_bytes = read_graph(self.folder, manifest, phase)
            file = self.folder / self.manifest["graphs"][phase]["file"]
            disabled = CPU_DISABLED_OPTIMIZERS if device == "cpu" else None
            try:
                self.sessions[phase] = ort.InferenceSession(graph_bytes, sess_options=options,
                                                            providers=phase_providers, disabled_optimizers=disabled)
            except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph types
                if not (self.cuda_graphs and phase == "decode" and cuda_graphs is None):
                    raise ManifestError(f"ONNX Runtime could not load {file}: {_one_line(err)}; re-run the export") from err
                # CUDA graphs were the default, not asked for: a graph ONNX Runtime will not capture (a
                # node it keeps on the CPU) still runs, step by step; its reason is kept.
                self.cuda_graphs, self.cuda_graphs_refused = False, _one_line(err)
                self.sessions[phase] = ort.InferenceSession(graph_bytes, sess_options=options, providers=providers,
                                                            disabled_optimizers=disabled)
            self._check_session_io(phase, self.sessions[phase])
        self.logits_dtype = self._logits_dtype()
        self.vocab_size = ModelSpec.from_manifest(manifest).vocab_size
        self.runs = {"prefill": 0, "decode": 0}
        self.allocations = 0
        self._runs_lock = threading.Lock()
        if max_capacity is not None and (isinstance(max_capacity, bool) or not isinstance(max_capacity, int)
                                         or max_capacity < 1):
            raise InputError(f"max_capacity must be a positive integer, got {max_capacity!r}")
        self.limits = Limits.from_manifest(manifest, max_capacity=max_capacity)

    # -- checks ---------------------------------------------------------------------------------
    def _check_session_io(self, phase: str, session: ort.InferenceSession) -> None:
        want = GraphIO.of(phase, self.kv)
        file = self.manifest["graphs"][phase]["file"]
        have_in = [node.name for node in session.get_inputs()]
        have_out = [node.name for node in session.get_outputs()]
        if sorted(have_in) != sorted(want.inputs) or sorted(have_out) != sorted(want.outputs):
            raise ManifestError(
                f"{file} has inputs {have_in} and outputs {have_out}, "
                f"which disagree with its manifest; the folder was modified, re-run the export"
            )
        # Dtypes and fixed dimensions the manifest states must be the graph's: the runtime sizes its
        # buffers from the manifest, so a mismatch would only show as an ONNX Runtime error mid-run.
        kv = self.kv
        vocab = ModelSpec.from_manifest(self.manifest).vocab_size
        for node in list(session.get_inputs()) + list(session.get_outputs()):
            entry = io_entry(self.manifest, phase, node.name) or {}
            dtype = _ORT_DTYPES.get(node.type, node.type)
            if "dtype" in entry and entry["dtype"] != dtype:
                raise ManifestError(
                    f"{file}: {node.name} is {dtype} but the manifest says {entry['dtype']}; re-run the export"
                )
            wanted = entry.get("shape")
            if node.name == LOGITS and node.shape and isinstance(node.shape[-1], int) and node.shape[-1] != vocab:
                # The logits buffers are sized by vocab_size: a manifest claiming another size (1e12)
                # would allocate by it, or hand back garbage rows.
                raise ManifestError(
                    f"{file}: its logits have {node.shape[-1]} entries per position but the manifest's "
                    f"model.vocab_size is {vocab}; the manifest was modified: re-run the export"
                )
            if parse_cache_name(node.name) is not None:
                wanted = [None, kv.num_kv_heads, None, kv.head_dim]
                if dtype != kv.dtype:
                    raise ManifestError(
                        f"{file}: {node.name} is {dtype} but the manifest's KV cache dtype is {kv.dtype}; "
                        "re-run the export"
                    )
            if wanted is None:
                continue
            shape = list(node.shape)
            fixed_disagree = len(shape) != len(wanted) or any(
                isinstance(w, int) and isinstance(h, int) and w != h for w, h in zip(wanted, shape, strict=False)
            )
            if fixed_disagree:
                raise ManifestError(
                    f"{file}: {node.name} has shape {shape} but the manifest says {wanted}; the manifest and the "
                    "graph disagree, re-run the export"
                )

    def _logits_dtype(self) -> type:
        entry = io_entry(self.manifest, "decode", LOGITS)
        if entry is None or LOGITS not in io_names(self.manifest["graphs"]["decode"], "outputs"):
            raise ManifestError(f"the manifest's decode graph has no {LOGITS!r} output; re-run the export")
        dtype = entry.get("dtype", "float32")
        if dtype not in LOGITS_DTYPES:
            raise ManifestError(f"logits dtype {dtype!r} is not supported; expected {sorted(LOGITS_DTYPES)}")
        return LOGITS_DTYPES[dtype]

    # -- the backend protocol (runtime/backend.py) -----------------------------------------------
    def allocate(self, batch: int, capacity: int) -> OrtSlot:
        """A KV cache of this shape on the backend's device, bound to both phases in place."""
        cache = KVCache.from_manifest(self.manifest, batch, capacity, device=self.device, device_id=self.device_id,
                                      on_device=self.on_device)
        cache.max_capacity = self.limits.max_capacity
        with self._runs_lock:
            self.allocations += 1
        return self.bind(cache)

    def prefill(self, slot: OrtSlot, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        return self.run_prefill(slot, input_ids, logits_index)

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
        inputs = slot.host_values
        if self.on_device:
            single = self.session_mode == "single"
            slot.device_values = {
                PAST_LENS: self._device_array(np.zeros(batch, np.int32)),
                "decode_ids": self._device_array(slot.decode_ids),
                "decode_index": self._device_array(slot.decode_index),
                LOGITS: self._device_array(np.zeros((batch, 1, self.vocab_size) if single else (batch, self.vocab_size),
                                                    self.logits_dtype)),
            }
            inputs = slot.device_values
            slot.decode_options = self._decode_run_options()
        for phase, session in self.sessions.items():
            binding = session.io_binding()
            order: list[str] = []
            binding.bind_ortvalue_input(PAST_LENS, inputs[PAST_LENS])
            if phase == "decode":
                binding.bind_ortvalue_input(INPUT_IDS, inputs["decode_ids"])
                if self.session_mode == "single":
                    binding.bind_ortvalue_input(LOGITS_INDEX, inputs["decode_index"])
            per_position = phase == "prefill" or self.session_mode == "single"  # the prefill graph runs
            if self.on_device and phase == "decode":
                binding.bind_ortvalue_output(LOGITS, slot.device_values[LOGITS])
            else:  # prefill: into the host buffer (ONNX Runtime copies device outputs there after the run)
                binding.bind_ortvalue_output(LOGITS, slot.host_values[LOGITS_POSITIONS if per_position else LOGITS])
            order.append(LOGITS)
            for layer, kind in self.kv.buffers():
                self._bind_cache(binding, cache, layer, kind)
                order.append(cache_output(kind, layer))
            slot.bindings[phase] = binding
            slot.output_order[phase] = order
        return slot

    def _bind_cache(self, binding: ort.IOBinding, cache: KVCache, layer: int, kind: str) -> None:
        """Bind one cache buffer as both past_* and present_*: its OrtValue, or (a device view, which has
        none) its address with the view's shape."""
        if cache.keys:
            buffer = (cache.keys if kind == "key" else cache.values)[layer]
            binding.bind_ortvalue_input(cache_input(kind, layer), buffer)
            binding.bind_ortvalue_output(cache_output(kind, layer), buffer)
            return
        pointer = cache.buffer_pointers()[2 * layer + (kind == "value")]
        dtype = cache.host_dtype
        binding.bind_input(cache_input(kind, layer), self.device, self.device_id, dtype, list(cache.shape), pointer)
        binding.bind_output(cache_output(kind, layer), self.device, self.device_id, dtype, list(cache.shape), pointer)

    def _device_array(self, array: np.ndarray) -> ort.OrtValue:
        """A device OrtValue holding a copy of `array` (so it starts initialised)."""
        value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, self.device, self.device_id)
        value.update_inplace(np.ascontiguousarray(array))
        return value

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

    # -- row operations (runtime/backend.py) -----------------------------------------------------
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
    def run_prefill(self, slot: OrtSlot, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """input_ids [B, S] int64 (right-padded); logits_index [B] -> logits [B, V] float32, or
        [B, K] (K positions per row, e.g. to verify speculative drafts) -> logits [B, K, V].
        Writes positions past_lens[b] + 0..S-1 of every row; the caller advances past_lens."""
        slot.cache.check_fits(input_ids.shape[1])
        binding = slot.bindings["prefill"]
        index = np.ascontiguousarray(logits_index, dtype=np.int64)
        per_row = index.ndim == 1
        index = index.reshape(index.shape[0], -1)
        # Prefill runs once per request (or per verification), so binding fresh arrays costs little.
        slot.prefill_inputs = (np.ascontiguousarray(input_ids, dtype=np.int64), index)
        binding.bind_cpu_input(INPUT_IDS, slot.prefill_inputs[0])
        binding.bind_cpu_input(LOGITS_INDEX, index)
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
        return self._run(slot, "decode")

    def _run(self, slot: OrtSlot, phase: str) -> np.ndarray:
        if self.on_device:
            with self._device_lock:
                return self._run_on_device(slot, phase)
        self._session_run(slot, phase, _QUIET_RUN)
        # float32 logits are returned as a view of the slot's buffer: valid until its next run.
        return slot.logits if slot.logits.dtype == np.float32 else slot.logits.astype(np.float32)

    def _run_on_device(self, slot: OrtSlot, phase: str) -> np.ndarray:
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
        binding.synchronize_inputs()
        self._session_run(slot, phase, slot.decode_options if phase == "decode" else _QUIET_RUN)
        binding.synchronize_outputs()
        if phase == "decode":
            return values[LOGITS].numpy().reshape(slot.cache.batch, self.vocab_size).astype(np.float32, copy=False)
        return slot.logits if slot.logits.dtype == np.float32 else slot.logits.astype(np.float32)

    def _session_run(self, slot: OrtSlot, phase: str, options: ort.RunOptions) -> None:
        try:
            self.sessions[phase].run_with_iobinding(slot.bindings[phase], options)
        except Exception as err:  # ORT's own exception types; say which graph and why, on one line
            raise KvforgeError(
                f"ONNX Runtime failed running the {phase} graph of {self.folder}: {_one_line(err)}"
            ) from err
        with self._runs_lock:
            self.runs[phase] += 1

    def bound_output_addresses(self, slot: OrtSlot, phase: str) -> dict[str, int]:
        """Addresses of the outputs the last run of `phase` on `slot` wrote to, by output name.
        get_outputs() returns outputs in binding order, not graph order, hence the recorded order."""
        outputs = slot.bindings[phase].get_outputs()
        return {name: value.data_ptr() for name, value in zip(slot.output_order[phase], outputs, strict=True)}


class EmulateBackend(OrtBackend):
    """The `trt` target's graphs on ONNX Runtime CPU, kvforge's plugin node served in Python
    (runtime/emulate.py). Same options as ort-cpu, plus `emulation`: "triton" (the Triton kernel under
    its interpreter; default) or "reference" (the numpy reference, torch-free). Fixed per backend."""

    def __init__(
        self,
        folder: str | Path,
        manifest: dict[str, Any],
        device_id: int = 0,
        threads: int | None = None,
        sessions: str = "single",
        max_capacity: int | None = None,
        emulation: str | None = None,
    ) -> None:
        from kvforge.runtime import emulate

        self.emulation = emulate.resolve_mode(emulation)
        if manifest["kv_cache"]["dtype"] == "bfloat16":
            raise InputError(
                f"{folder} is a bf16 export: ONNX Runtime CPU has no bfloat16 kernels, so backend 'emulate' "
                "cannot run it; build TensorRT engines (--backend tensorrt), or export with --dtype fp32"
            )
        if manifest["kv_cache"]["dtype"] != "float32":
            raise InputError(
                f"backend 'emulate' runs fp32 trt exports only ({folder} is {manifest['dtype']}): its Python "
                "op bridge has no float16/bfloat16; export with --dtype fp32, or build TensorRT engines"
            )
        self.custom_ops_library = emulate.custom_ops_library(self.emulation)
        self._serving = emulate.serving
        super().__init__(folder, manifest, "cpu", device_id, threads, sessions, max_capacity)
        self.name = "emulate"

    def _run(self, slot: OrtSlot, phase: str) -> np.ndarray:
        # The plugin op is registered once per process: tell it which implementation this backend runs.
        with self._serving(self.emulation):
            return super()._run(slot, phase)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
