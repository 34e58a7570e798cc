"""A speculation head's graph (`draft.onnx`: an EAGLE-3 head or a checkpoint's MTP layer) on ONNX Runtime, over a
KV cache of its own.

The graph's IO is contract.GraphIO.draft(layout): input_ids [B, S], target_hidden [B, S, Dt], draft_hidden
[B, S, H], past_lens [B] int32 and the head's KV (its `past_*` and `present_*` bound to one buffer, written in
place like the target's) in; logits [B, S, Vd], hidden_out [B, S, H] and token_map [Vd] int64 out. The head's
cached position p holds the pair (token p + 1, the target's hidden state at p) and predicts token p + 2.

    runner = HeadRunner(folder, manifest)                        # the manifest's "draft" record and graph
    slot = runner.allocate(batch, capacity)                      # the head's KV cache, bound in place
    logits, hidden_out = runner.run(slot, ids, target_hidden, draft_hidden, past_lens, first=0)  # rows 0..R-1
    runner.token_map                                             # [Vd] target id of each head id, read once
    runner.copy_rows(slot, 3, slot, 0, positions)                # the scheduler's row moves

`run` writes positions past_lens[b] + 0..S-1 of rows 0..R-1 (R = len(input_ids)); it leaves lengths to the caller
(runtime/drivers/head_proposer.py keeps them per row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import (
    DRAFT,
    DRAFT_HIDDEN,
    DRAFT_KINDS,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    PAST_LENS,
    TARGET_HIDDEN,
    TOKEN_MAP,
    GraphIO,
    KVLayout,
    ModelSpec,
    cache_input,
    cache_output,
)
from kvforge.core.errors import CapacityError, InputError, KvforgeError, ManifestError
from kvforge.core.targets import Target
from kvforge.runtime.backends.backend import export_target
from kvforge.runtime.backends.kv_cache import KVCache
from kvforge.runtime.backends.ort_sessions import _QUIET_RUN, one_line, open_session, providers_for

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32}


@dataclass
class HeadSlot:
    """The head's KV cache and its bindings, one per number of leading rows a run covers."""

    cache: KVCache
    views: dict[tuple[int, int], ort.IOBinding] = field(default_factory=dict)  # (first row, rows) -> binding
    values: list[ort.OrtValue] = field(default_factory=list)  # the host views those bindings hold


def head_record(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's "draft" record, checked for what the runtime reads (ManifestError otherwise)."""
    record = manifest.get(DRAFT)
    if record is None:
        raise InputError("this export has no speculation head (no \"draft\" record in its manifest); re-export it "
                         "with one, or speculate with method 'draft' or 'prompt-lookup'")
    if not isinstance(record, dict) or record.get("kind") not in DRAFT_KINDS:
        raise ManifestError(f"the manifest's draft record must be an object whose kind is one of "
                            f"{', '.join(DRAFT_KINDS)}, got {record!r:.120}; re-run the export")
    graph = manifest.get("graphs", {}).get(DRAFT)
    if not isinstance(graph, dict) or graph.get("file") not in manifest.get("files", {}):
        raise ManifestError(f"the manifest lists no {DRAFT!r} graph (or its file is not in 'files'); re-run the export")
    return record


class HeadRunner:
    """The head graph of one export folder on ONNX Runtime (`device` "cpu" or "cuda", as the target's backend)."""

    def __init__(self, folder: str | Path, manifest: dict[str, Any], device: str = "cpu", device_id: int = 0,
                 threads: int | None = None, spinning: bool = True, target: Target | None = None) -> None:
        """`target`: the manifest's, where the caller resolved it already (LoadedExport.target)."""
        self.folder, self.manifest, self.device, self.device_id = Path(folder), manifest, device, device_id
        record = head_record(manifest)
        self.kind: str = record["kind"]
        try:
            self.session = open_session(self.folder, manifest, DRAFT, providers_for(device, device_id), device=device,
                                        threads=threads, spinning=spinning, sessions="single")
        except KvforgeError:
            raise
        except Exception as err:  # onnxruntime raises its own types
            raise ManifestError(f"ONNX Runtime could not load {self.folder}'s draft graph: {one_line(err)}; "
                                "re-run the export") from err
        inputs = {node.name: node for node in self.session.get_inputs()}
        outputs = {node.name: node for node in self.session.get_outputs()}
        self.layout = self._layout(record)
        GraphIO.draft(self.layout).check(list(inputs), list(outputs), f"{self.folder}/{DRAFT}.onnx")
        self.target_width = _width(inputs[TARGET_HIDDEN], record.get("target_hidden_size"))
        self.width = _width(inputs[DRAFT_HIDDEN], record.get("hidden_size"))
        self.dtypes = {name: _NUMPY.get(node.type) for name, node in {**inputs, **outputs}.items()}
        for name in (TARGET_HIDDEN, DRAFT_HIDDEN, LOGITS, HIDDEN_OUT):
            if self.dtypes[name] not in (np.float32, np.float16):
                raise ManifestError(f"the draft graph's {name} is {inputs.get(name, outputs.get(name)).type}, not "
                                    "float32 or float16; re-run the export")
        self.vocab_size = ModelSpec.from_manifest(manifest).vocab_size
        self.continue_batch = export_target(manifest, target).continue_batch
        self.token_map = self._read_token_map()
        self.draft_vocab_size = len(self.token_map)

    def _layout(self, record: dict[str, Any]) -> KVLayout:
        """The head's KV layout: the record's `kv_cache` (KVLayout's manifest form, kvforge/core/draft_manifest.py)."""
        try:
            layout = KVLayout.from_manifest({"kv_cache": record.get("kv_cache")})
        except ManifestError as err:
            raise ManifestError(f"{self.folder}: draft.{err}") from None
        if layout.states:
            raise ManifestError(f"{self.folder}: a speculation head keeps no recurrent state; re-run the export")
        return layout

    def _read_token_map(self) -> np.ndarray:
        """token_map [Vd]: a constant of the graph, read once by a one-position run over a scratch cache."""
        feeds: dict[str, np.ndarray] = {
            INPUT_IDS: np.zeros((1, 1), np.int64),
            TARGET_HIDDEN: np.zeros((1, 1, self.target_width), self.dtypes[TARGET_HIDDEN]),
            DRAFT_HIDDEN: np.zeros((1, 1, self.width), self.dtypes[DRAFT_HIDDEN]),
            PAST_LENS: np.zeros(1, np.int32),
        }
        for layer, kind in self.layout.buffers():
            shape = self.layout.buffer_shape(1, 1, layer, kind)
            feeds[cache_input(kind, layer)] = np.zeros(shape, self.dtypes[cache_input(kind, layer)])
        token_map = np.asarray(self._guarded(lambda: self.session.run([TOKEN_MAP], feeds, _QUIET_RUN))[0])
        if token_map.ndim != 1 or token_map.dtype != np.int64 or not len(token_map) \
                or token_map.min() < 0 or token_map.max() >= self.vocab_size:
            raise ManifestError(f"the draft graph's {TOKEN_MAP} is {token_map.dtype} {token_map.shape}, not [Vd] int64 "
                                f"ids below the target's vocab_size {self.vocab_size}; re-run the export")
        return token_map

    # -- the cache -------------------------------------------------------------------------------
    def allocate(self, batch: int, capacity: int) -> HeadSlot:
        """The head's KV cache for `batch` rows of `capacity` positions, on the runner's device."""
        cache = KVCache(self.layout.num_layers, batch, self.layout.num_kv_heads, capacity, self.layout.head_dim,
                        self.layout.dtype, self.device, self.device_id, max_capacity=capacity,
                        layer_shapes=self.layout.layers)
        return HeadSlot(cache)

    def copy_rows(self, src: HeadSlot, row: int, dst: HeadSlot, dst_row: int, positions: int) -> None:
        """Positions 0..positions-1 of `src`'s `row` into `dst`'s `dst_row` (the same slot or another)."""
        src.cache.copy_rows(row, dst.cache, dst_row, positions)

    def _view(self, slot: HeadSlot, first: int, rows: int) -> ort.IOBinding:
        """A binding of rows first..first+rows-1 of the cache as both past_* and present_*, in place: a block of
        leading-dimension rows of a [B, ...] buffer is one contiguous run of memory."""
        binding = slot.views.get((first, rows))
        if binding is not None:
            return binding
        cache = slot.cache
        binding = self.session.io_binding()
        host = None if cache.on_device else [array for layer in cache.host_layers() for array in layer]
        for index, (layer, kind) in enumerate(cache.buffers()):
            names = cache_input(kind, layer), cache_output(kind, layer)
            if host is not None:
                value = ort.OrtValue.ortvalue_from_numpy(host[index][first:first + rows])
                binding.bind_ortvalue_input(names[0], value)
                binding.bind_ortvalue_output(names[1], value)
                slot.values.append(value)  # the binding holds no reference of its own
                continue
            shape = list(cache.buffer_shape(layer, kind))
            dtype = cache.host_dtypes[index]
            pointer = cache.buffer_pointers()[index] + first * math.prod(shape[1:]) * dtype.itemsize
            shape[0] = rows
            binding.bind_input(names[0], self.device, self.device_id, dtype, shape, pointer)
            binding.bind_output(names[1], self.device, self.device_id, dtype, shape, pointer)
        slot.views[(first, rows)] = binding
        return binding

    # -- running ---------------------------------------------------------------------------------
    def run(self, slot: HeadSlot, input_ids: np.ndarray, target_hidden: np.ndarray, draft_hidden: np.ndarray,
            past_lens: np.ndarray, first: int = 0, active: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One call over rows first..first+R-1 of `slot` (R = len(input_ids)): input_ids [R, S] (target ids),
        target_hidden [R, S, Dt], draft_hidden [R, S, H], past_lens [R] -> (logits [R, S, Vd] float32,
        hidden_out [R, S, H]). Writes the head's positions past_lens[r] + 0..S-1 of each row. `active`: the
        indices (of R) whose outputs are read; where the target's attention extends one row at a time
        (contract: Target.continue_batch, ONNX Runtime's GroupQueryAttention), a call of several positions after
        a past runs those rows one by one, and the others' outputs are zeros."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] < 1 or not 0 <= first or first + ids.shape[0] > slot.cache.batch:
            raise InputError(f"input_ids of shape {ids.shape} from row {first}: expected [rows, positions >= 1] "
                             f"within the head cache's {slot.cache.batch} rows")
        rows, seq = ids.shape
        lens = np.ascontiguousarray(past_lens, dtype=np.int32).reshape(-1)
        states = [np.ascontiguousarray(array, dtype=self.dtypes[name]) for array, name in
                  ((target_hidden, TARGET_HIDDEN), (draft_hidden, DRAFT_HIDDEN))]
        wanted = [(rows, seq, self.target_width), (rows, seq, self.width)]
        if lens.shape != (rows,) or [s.shape for s in states] != wanted:
            raise InputError(f"the head takes past_lens [{rows}], target_hidden {list(wanted[0])} and draft_hidden "
                             f"{list(wanted[1])}; got {list(lens.shape)}, {[list(s.shape) for s in states]}")
        if lens.min() < 0 or int(lens.max()) + seq > slot.cache.capacity:
            raise CapacityError(f"this head call needs {int(lens.max()) + seq} positions but the head's cache holds "
                                f"{slot.cache.capacity}")
        logits = np.zeros((rows, seq, self.draft_vocab_size), self.dtypes[LOGITS])
        hidden = np.zeros((rows, seq, self.width), self.dtypes[HIDDEN_OUT])
        if rows > 1 and seq > 1 and self.continue_batch is not None and lens.max() > 0:
            for r in range(rows) if active is None else active:
                self._run(slot, first + r, ids[r:r + 1], states[0][r:r + 1], states[1][r:r + 1], lens[r:r + 1],
                          logits[r:r + 1], hidden[r:r + 1])
        else:
            self._run(slot, first, ids, states[0], states[1], lens, logits, hidden)
        return logits.astype(np.float32, copy=False), hidden

    def _run(self, slot: HeadSlot, first: int, ids: np.ndarray, target_hidden: np.ndarray, draft_hidden: np.ndarray,
             lens: np.ndarray, logits: np.ndarray, hidden: np.ndarray) -> None:
        binding = self._view(slot, first, len(ids))
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(TARGET_HIDDEN, target_hidden)
        binding.bind_cpu_input(DRAFT_HIDDEN, draft_hidden)
        binding.bind_cpu_input(PAST_LENS, lens)
        # Outputs into the caller's arrays (ONNX Runtime copies a device output there after the run).
        binding.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_output(HIDDEN_OUT, ort.OrtValue.ortvalue_from_numpy(hidden))
        self._guarded(lambda: self.session.run_with_iobinding(binding, _QUIET_RUN))
        if self.device != "cpu":
            binding.synchronize_outputs()

    def _guarded(self, call: Any) -> Any:
        try:
            return call()
        except Exception as err:  # ORT's own exception types; say which graph and why, on one line
            raise KvforgeError(f"ONNX Runtime failed running the draft graph of {self.folder}: {one_line(err)}") \
                from err


def _width(node: Any, recorded: Any) -> int:
    """The last dimension of a graph input: its fixed size, which a record's value must equal where it has one."""
    size = node.shape[-1] if node.shape else None
    if isinstance(size, int) and size > 0:
        if recorded is not None and recorded != size:
            raise ManifestError(f"the draft graph's {node.name} is {size} wide, its record says {recorded}; "
                                "re-run the export")
        return size
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    raise ManifestError(f"the draft graph's {node.name} has no fixed width ({node.shape}); re-run the export")
