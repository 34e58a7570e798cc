"""TensorRT backend (`--backend tensorrt`): the engines `kvforge build` wrote, over device KV buffers bound in place.

- Each slot owns its device buffers: per layer one key and one value buffer, bound as both past_*
  and present_* (`set_tensor_address` with the same pointer; the `trt` target's plugin declares the
  aliasing, TensorRT's native attention import writes through TensorScatter in place).
- Input shapes are set per run; `execute_async_v3` runs on one CUDA stream.
- A decode step of a slot has fixed shapes and addresses, so from its second decode step on it is
  replayed from a CUDA graph (one graph per slot: batch x capacity bucket); only the token ids and
  `past_lens` are uploaded before each replay. TensorRT wants one execution context per captured graph
  and an enqueue right before the capture, so a slot that captures gets its own decode context (the
  decode engine's, on the decode profile), whose warm-up run (this step's run) is followed by a
  stream sync, then the capture. Each such context holds its own activation memory.
- Slots that do not capture, and every prefill, share one context per phase, bound before each run.
- Logits come back through a pinned host buffer; the Generator samples on the host.
- Everything that reaches the stream (allocation memsets, uploads, runs, captures, downloads, syncs)
  happens under one lock: a capture in one thread can never record, or be invalidated by, another
  thread's work. Concurrent requests each keep their own cache and interleave their steps.
- `device_id` is made the current GPU before the stream and the engines are created, and again in
  whichever thread calls in (CUDA's current device is per thread).

- The engines load under the TensorRT flavour that built them (standard TensorRT or TensorRT-RTX,
  kvforge/core/tensorrt_flavor.py). `onnx`-target engines fix the cache capacity at --max-seq-len, so
  every slot is allocated at that one capacity.

TensorRT and cuda-python are imported when the backend is created, never at `import kvforge.runtime`.
Not verified on a GPU with TensorRT (none was available); engines are built for real with TensorRT-RTX
on the CPU, and the logic here is tested against stand-ins (tests/engines/test_trt_backend_glue.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core import cuda
from kvforge.core.contract import (
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    PAST_LENS,
    KVLayout,
    ModelSpec,
    buffer_name,
    cache_input,
)
from kvforge.core.engine_plan import (
    ENGINE_DIR_NAME,
    MAX_POSITIONS,
    binding_plan,
    check_runtime_matches,
    engine_file_problem,
    load_engines_manifest,
)
from kvforge.core.errors import (
    BackendUnavailableError,
    CapacityError,
    InputError,
    KvforgeError,
    ManifestError,
)
from kvforge.core.targets import Target
from kvforge.core.tensorrt_flavor import gpu_refusal, load_tensorrt
from kvforge.runtime.backends.backend import Limits, export_target
from kvforge.runtime.backends.kv_cache import (
    CacheState,
    check_row_arrays,
    device_copy_rows,
    device_read_rows,
    device_write_rows,
)


@dataclass
class TrtSlot:
    cache: CacheState
    buffers: dict[str, cuda.DeviceBuffer]
    logits: cuda.PinnedArray
    bound: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> output name -> address
    context: Any = None  # the slot's own decode execution context, created when its decode is captured
    graph: cuda.Graph | None = None  # captured on `context`
    decode_runs: int = 0


class TrtBackend:
    """Options: `engine_dir` (default EXPORT_DIR/engines), `device_id` (the GPU to run on, default 0),
    `cuda_graphs` (replay decode steps from a CUDA graph, default True)."""

    def __init__(self, folder: str | Path, manifest: dict[str, Any], engine_dir: str | Path | None = None,
                 device_id: int = 0, cuda_graphs: bool = True, target: Target | None = None) -> None:
        self.name = "tensorrt"
        self.folder = Path(folder)
        self.manifest = manifest
        self.engine_dir = Path(engine_dir) if engine_dir is not None else self.folder / ENGINE_DIR_NAME
        self.engines_manifest = load_engines_manifest(self.engine_dir, self.folder)
        # The flavour that built the engines (standard TensorRT or TensorRT-RTX) is the one that loads them.
        built_with = self.engines_manifest.get("tensorrt", {})
        self.tensorrt = load_tensorrt(built_with.get("flavor", "auto"))
        trt = self.tensorrt.module
        count = cuda.device_count()
        if count == 0:
            raise BackendUnavailableError("the tensorrt backend needs an NVIDIA GPU; CUDA reports none (`kvforge "
                                          "doctor` shows what runs here)")
        if not 0 <= int(device_id) < count:
            raise InputError(f"device_id {device_id} but CUDA reports {count} GPUs (0..{count - 1})")
        self.device_id = int(device_id)
        cuda.set_device(self.device_id)  # the stream, the engines and their contexts belong to this GPU
        gpu = cuda.device_info(device_id)
        refusal = gpu_refusal(self.tensorrt.flavor, gpu)
        if refusal is not None:  # before any engine is read: TensorRT's own error would advise a rebuild
            raise BackendUnavailableError(refusal)
        check_runtime_matches(self.engines_manifest, self.tensorrt.record(), gpu["compute_capability"])
        if export_target(manifest, target).plugin is not None:  # `target`: a LoadedExport's, resolved at its load
            from kvforge.plugins import trt_plugin

            trt_plugin.register()  # the plugin's creator, for engines that ask for it at load
        self.stream = cuda.Stream()
        self.cuda_graphs = bool(cuda_graphs)
        options = self.engines_manifest["options"]
        self.single_engine = bool(options["single_engine"])
        self.max_input_len = int(options["max_input_len"])
        # `onnx`-target engines fix the capacity at --max-seq-len (TensorRT's KV-cache-update layer needs it
        # static): their one bucket is that capacity, and every slot is allocated at it.
        self.static_capacity = bool(self.engines_manifest.get("static_capacity", False))
        self.limits = Limits(int(options["max_batch"]), int(options["max_seq_len"]),
                             tuple(int(c) for c in self.engines_manifest["capacity_buckets"]))
        self.runs = {"prefill": 0, "decode": 0}
        self.allocations = 0
        self._lock = threading.Lock()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engines: dict[str, Any] = {}
        self.contexts: dict[str, Any] = {}  # the shared context of each phase
        for phase, entry in self.engines_manifest["engines"].items():
            engine = self._engines.get(entry["file"]) or self._load_engine(entry["file"])
            self._engines[entry["file"]] = engine
            self.contexts[phase] = self._new_context(phase)
        self.kv = kv = KVLayout.from_manifest(manifest)
        self.num_layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.kv_dtype = kv.dtype
        self.vocab_size = ModelSpec.from_manifest(manifest).vocab_size

    def _load_engine(self, name: str) -> Any:
        # What is hashed is what is loaded: the bytes checked against engines.json go to TensorRT.
        # First the path (a symbolic link is refused before it is followed), then the bytes read.
        record = self.engines_manifest["files"][name]  # every engine is listed (load_engines_manifest)
        problem = engine_file_problem(self.engine_dir, name, record, check_sha256=False)
        if problem is None:
            data = (self.engine_dir / name).read_bytes()
            problem = engine_file_problem(self.engine_dir, name, record, data)
        if problem is not None:
            raise ManifestError(f"{problem}; rebuild with `kvforge build {self.folder} --force`")
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise KvforgeError(f"TensorRT could not load {self.engine_dir / name}; rebuild with `kvforge build --force`")
        return engine

    def _new_context(self, phase: str) -> Any:
        """An execution context of `phase`'s engine on `phase`'s optimization profile (the decode profile is
        1 in a --single-engine engine)."""
        entry = self.engines_manifest["engines"][phase]
        context = self._engines[entry["file"]].create_execution_context()
        if context is None:
            raise KvforgeError(f"TensorRT could not create an execution context for {entry['file']}")
        if entry["profile"]:
            context.set_optimization_profile_async(int(entry["profile"]), int(self.stream))
        return context

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """The lock, with this backend's GPU current in the calling thread. All stream work happens under it,
        so none can land in (or break) a CUDA graph another thread is capturing."""
        with self._lock:
            cuda.set_device(self.device_id)
            yield

    # -- the backend protocol (runtime/backends/backend.py) -----------------------------------------------
    def allocate(self, batch: int, capacity: int) -> TrtSlot:
        if batch > self.limits.max_batch:
            raise CapacityError(f"{batch} rows but the engines were built for --max-batch {self.limits.max_batch}")
        if capacity > self.limits.max_capacity:
            raise CapacityError(f"capacity {capacity} but the engines were built for --max-seq-len {self.limits.max_capacity}")
        if self.static_capacity:
            capacity = self.limits.max_capacity
        cache = CacheState(self.num_layers, batch, self.kv_heads, capacity, self.head_dim, self.kv_dtype,
                           self.limits.max_capacity, self.kv.layers)
        sizes = {buffer_name(kind, layer): self.kv.buffer_bytes(batch, capacity, layer) for layer, kind in self.kv.buffers()}
        with self._on_device():  # the buffers' zeroing memsets go on the stream
            buffers = {name: cuda.DeviceBuffer(size, self.stream) for name, size in sizes.items()}
            slot = self._slot(cache, buffers)
            self.allocations += 1
        return slot

    def _slot(self, cache: CacheState, kv_buffers: dict[str, cuda.DeviceBuffer]) -> TrtSlot:
        """A slot over `kv_buffers` with its own step buffers (ids, lengths, logits) sized for `cache`."""
        batch, seq = cache.batch, min(self.max_input_len, cache.capacity)
        # Buffers by the names binding_plan() (kvforge/core/engine_plan.py) gives them.
        sizes = {INPUT_IDS: batch * seq * 8, "decode_ids": batch * 8, PAST_LENS: batch * 4,
                 LOGITS_INDEX: batch * MAX_POSITIONS * 8, "decode_index": batch * 8,
                 LOGITS: batch * MAX_POSITIONS * self.vocab_size * 4}
        buffers = {name: cuda.DeviceBuffer(size, self.stream) for name, size in sizes.items()}
        self.stream.synchronize()
        return TrtSlot(cache, {**buffers, **kv_buffers}, cuda.PinnedArray((batch, self.vocab_size), np.float32))

    # -- row operations (serving) -----------------------------------------------------------------
    def _kv_pointers(self, slot: TrtSlot) -> list[int]:
        return [slot.buffers[buffer_name(kind, layer)].ptr for layer, kind in self.kv.buffers()]

    def view_rows(self, slot: TrtSlot, rows: int) -> TrtSlot:
        """A slot over the first `rows` rows of `slot`'s KV buffers (the same memory and past_lens),
        with its own step buffers, so a decode step of a smaller batch runs in place (and captures its
        own CUDA graph)."""
        cache = slot.cache.first_rows(rows)
        with self._on_device():
            return self._slot(cache, {buffer_name(kind, layer): slot.buffers[buffer_name(kind, layer)]
                                      for layer, kind in self.kv.buffers()})

    def copy_rows(self, src: TrtSlot, row: int, dst: TrtSlot, dst_row: int, positions: int) -> None:
        src.cache.check_row(row, positions)
        dst.cache.check_row(dst_row, positions)
        if positions:
            with self._on_device():
                device_copy_rows(src.cache, self._kv_pointers(src), row, dst.cache, self._kv_pointers(dst), dst_row,
                                 positions, self._kv_itemsize)

    def read_rows(self, slot: TrtSlot, row: int, positions: int) -> list[tuple[np.ndarray, np.ndarray]]:
        slot.cache.check_row(row, positions)
        with self._on_device():
            return device_read_rows(slot.cache, self._kv_pointers(slot), row, positions, self._kv_host_dtype)

    def write_rows(self, slot: TrtSlot, row: int, layers: list[tuple[np.ndarray, np.ndarray]], positions: int) -> None:
        slot.cache.check_row(row, positions)
        check_row_arrays(slot.cache, layers, positions)
        with self._on_device():
            device_write_rows(slot.cache, self._kv_pointers(slot), row, layers, positions, self._kv_host_dtype)

    @property
    def _kv_host_dtype(self) -> np.dtype:  # bfloat16 rows travel as uint16 bits
        return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.kv_dtype])

    @property
    def _kv_itemsize(self) -> int:
        return self._kv_host_dtype.itemsize

    def prefill(self, slot: TrtSlot, input_ids: np.ndarray, logits_index: np.ndarray,
                image_features: np.ndarray | None = None, positions: np.ndarray | None = None) -> np.ndarray:
        """logits_index [B] -> logits [B, V]; [B, K] -> [B, K, V] (K <= MAX_POSITIONS)."""
        if image_features is not None or positions is not None:  # the trt target exports no vision-language model
            raise InputError("the tensorrt backend takes no images: its exports are text models")
        batch, seq = input_ids.shape
        slot.cache.check_fits(seq)
        if seq > self.max_input_len:
            raise CapacityError(f"a {seq}-token prefill but the engines were built for --max-input-len {self.max_input_len}")
        index = np.asarray(logits_index, dtype=np.int64)
        per_row = index.ndim == 1
        index = index.reshape(batch, -1)
        positions = index.shape[1]
        if positions > MAX_POSITIONS:
            raise CapacityError(f"{positions} logits positions per row; the engines return at most {MAX_POSITIONS}")
        with self._on_device():
            slot.buffers[INPUT_IDS].upload(input_ids.astype(np.int64), self.stream)
            slot.buffers[LOGITS_INDEX].upload(index, self.stream)
            slot.buffers[PAST_LENS].upload(slot.cache.past_lens, self.stream)
            self._bind(slot, "prefill", seq, positions)
            self._execute(self.contexts["prefill"], "prefill")
            if per_row:
                return self._finish(slot, "prefill")
            wide = np.empty((batch, positions, self.vocab_size), dtype=np.float32)
            slot.buffers[LOGITS].download(wide, self.stream)
            self.stream.synchronize()
            self.runs["prefill"] += 1
            return wide

    def decode(self, slot: TrtSlot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray:
        slot.cache.check_fits(1, running)
        with self._on_device():
            slot.buffers["decode_ids"].upload(np.asarray(token_ids, dtype=np.int64).reshape(-1, 1), self.stream)
            slot.buffers[PAST_LENS].upload(slot.cache.past_lens, self.stream)
            if slot.graph is not None:
                slot.graph.launch(self.stream)
            elif self.cuda_graphs and slot.decode_runs >= 1:
                # A context of its own (no other slot rebinds it between capture and replay), warmed up by
                # this step's run and a sync right before the capture; the graph replays from the next step.
                context = slot.context = self._new_context("decode")
                self._bind(slot, "decode", 1, context)
                self._execute(context, "decode")
                self.stream.synchronize()
                slot.graph = cuda.Graph(self.stream, lambda: self._execute(context, "decode"))
            else:
                self._bind(slot, "decode", 1)
                self._execute(self.contexts["decode"], "decode")
            slot.decode_runs += 1
            return self._finish(slot, "decode", running)

    def kv_addresses(self, slot: TrtSlot) -> dict[str, int]:
        return {cache_input(kind, layer): slot.buffers[buffer_name(kind, layer)].ptr for layer, kind in self.kv.buffers()}

    def bound_output_addresses(self, slot: TrtSlot, phase: str) -> dict[str, int]:
        return dict(slot.bound.get(phase, {}))

    def target_hidden(self, slot: TrtSlot) -> np.ndarray:
        """Refused: speculation heads (draft.onnx) run beside ONNX Runtime backends only."""
        from kvforge.runtime.backends.target_hidden import heads_refused

        raise heads_refused(self.name)

    def read_kv(self, slot: TrtSlot, layer: int) -> tuple[np.ndarray, np.ndarray]:
        shape = slot.cache.buffer_shape(layer)
        out = []
        for kind in ("key", "value"):
            raw = np.empty(shape, dtype=self._kv_host_dtype)
            with self._on_device():
                slot.buffers[f"{kind}.{layer}"].download(raw, self.stream)
                self.stream.synchronize()
            if self.kv_dtype == "bfloat16":  # numpy has no bfloat16: widen the bit pattern to float32
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            out.append(raw)
        return out[0], out[1]

    # -- running --------------------------------------------------------------------------------
    def _bind(self, slot: TrtSlot, phase: str, seq: int, positions: int = 1, context: Any = None) -> None:
        """Set shapes and addresses on `context` (default: the phase's shared context)."""
        context = context if context is not None else self.contexts[phase]
        plan = binding_plan(self.manifest, phase, slot.cache.batch, slot.cache.capacity, seq, self.single_engine,
                            positions)
        for binding in plan:
            if binding.is_input and not context.set_input_shape(binding.name, binding.shape):
                raise KvforgeError(f"TensorRT refused shape {binding.shape} for {binding.name} ({phase}); "
                                   "outside the engine's profile: rebuild with larger limits")
            context.set_tensor_address(binding.name, slot.buffers[binding.buffer].ptr)
        slot.bound[phase] = {b.name: int(context.get_tensor_address(b.name)) for b in plan if not b.is_input}

    def _execute(self, context: Any, phase: str) -> None:
        if not context.execute_async_v3(int(self.stream)):
            raise KvforgeError(f"TensorRT failed to run the {phase} engine")

    def _finish(self, slot: TrtSlot, phase: str, rows: np.ndarray | None = None) -> np.ndarray:
        logits = slot.logits.array
        if rows is None or rows.all():
            slot.buffers[LOGITS].download(logits, self.stream)
        else:  # only the rows that still sample come back; finished rows' logits are never read
            for b in np.flatnonzero(rows):
                slot.buffers[LOGITS].download(logits[b], self.stream, offset=int(b) * logits[b].nbytes)
        self.stream.synchronize()
        self.runs[phase] += 1
        return slot.logits.array
