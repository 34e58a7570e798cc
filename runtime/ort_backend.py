"""ONNX Runtime backend: one session per phase, IO binding over the preallocated KV cache.

Every `past_*` input and its `present_*` output are bound to the very same OrtValue, so the fused
attention node writes the new rows in place (ORT's GroupQueryAttention compares the pointers).
The decode inputs and the logits output are preallocated and bound once per cache: a decode step
writes into those numpy arrays and runs, nothing else is allocated or rebound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.errors import BackendUnavailableError, InputError, ManifestError
from kvforge.runtime.kv_cache import KVCache

DEVICES = ("cpu", "cuda")
# "single": the prefill graph serves decode steps too (one session, one weight copy, prepacked);
# "shared": prefill.onnx + decode.onnx over one memory-mapped weight copy, prepacking off;
# "separate": prefill.onnx + decode.onnx, each session prepacks its own copy (two copies).
SESSION_MODES = ("single", "shared", "separate")
LOGITS_DTYPES = {"float32": np.float32, "float16": np.float16}


def expected_io(phase: str, num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of a phase under the KV cache contract."""
    inputs = ["input_ids", "past_lens"] + (["logits_index"] if phase == "prefill" else [])
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key.{i}", f"past_value.{i}"]
        outputs += [f"present_key.{i}", f"present_value.{i}"]
    return inputs, outputs


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


class OrtBackend:
    """The prefill and decode sessions of one export folder."""

    def __init__(
        self,
        folder: str | Path,
        manifest: dict[str, Any],
        device: str = "cpu",
        device_id: int = 0,
        threads: int | None = None,
        sessions: str = "single",
    ) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.device = device
        self.device_id = device_id
        self.num_layers = int(manifest["kv_cache"]["num_layers"])
        providers = providers_for(device, device_id)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        if sessions not in SESSION_MODES:
            raise InputError(f"unknown sessions mode {sessions!r}; choose one of {', '.join(SESSION_MODES)}")
        self.session_mode = sessions
        self.sessions: dict[str, ort.InferenceSession] = {}
        for phase in ("prefill", "decode"):
            self._check_manifest_io(phase, self.manifest["graphs"][phase])
            if sessions == "single" and phase == "decode":
                # The prefill graph takes any S, so S=1 is a decode step: one session, one copy of
                # the weights, and ORT may prepack them (its CPU matmuls are faster packed).
                self.sessions["decode"] = self.sessions["prefill"]
                continue
            path = self.folder / self.manifest["graphs"][phase]["file"]
            options = ort.SessionOptions()
            if threads is not None:
                options.intra_op_num_threads = threads
            if sessions == "shared":
                # ORT memory-maps the external weights file, so both sessions read the same page-cache
                # copy. The CPU kernels' prepacking would make a private packed copy per session (two
                # copies of the weights); turning it off keeps one, at some decode speed.
                options.add_session_config_entry("session.disable_prepacking", "1")
            try:
                self.sessions[phase] = ort.InferenceSession(str(path), sess_options=options, providers=providers)
            except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph types
                raise ManifestError(f"ONNX Runtime could not load {path}: {err}") from err
            self._check_session_io(phase, self.sessions[phase])
        self.logits_dtype = self._logits_dtype()
        self.vocab_size = int(manifest["model"]["vocab_size"])
        self.runs = {"prefill": 0, "decode": 0}
        self.cache: KVCache | None = None
        self._bindings: dict[str, ort.IOBinding] = {}
        self._output_order: dict[str, list[str]] = {}

    # -- checks ---------------------------------------------------------------------------------
    def _check_manifest_io(self, phase: str, graph: dict[str, Any]) -> None:
        want_in, want_out = expected_io(phase, self.num_layers)
        have_in = [entry["name"] for entry in graph.get("inputs", [])]
        have_out = [entry["name"] for entry in graph.get("outputs", [])]
        if sorted(have_in) != sorted(want_in) or sorted(have_out) != sorted(want_out):
            raise ManifestError(
                f"the manifest's {phase} graph IO does not follow the KV cache contract: inputs {have_in}, "
                f"outputs {have_out}; expected inputs {want_in} and outputs {want_out}; re-run the export"
            )

    def _check_session_io(self, phase: str, session: ort.InferenceSession) -> None:
        want_in, want_out = expected_io(phase, self.num_layers)
        have_in = [node.name for node in session.get_inputs()]
        have_out = [node.name for node in session.get_outputs()]
        if sorted(have_in) != sorted(want_in) or sorted(have_out) != sorted(want_out):
            raise ManifestError(
                f"{self.manifest['graphs'][phase]['file']} has inputs {have_in} and outputs {have_out}, "
                f"which disagree with its manifest; the folder was modified, re-run the export"
            )

    def _logits_dtype(self) -> type:
        for entry in self.manifest["graphs"]["decode"]["outputs"]:
            if entry["name"] == "logits":
                dtype = entry.get("dtype", "float32")
                if dtype not in LOGITS_DTYPES:
                    raise ManifestError(f"logits dtype {dtype!r} is not supported; expected {sorted(LOGITS_DTYPES)}")
                return LOGITS_DTYPES[dtype]
        raise ManifestError("the manifest's decode graph has no 'logits' output; re-run the export")

    # -- binding --------------------------------------------------------------------------------
    def attach(self, cache: KVCache) -> None:
        """Bind `cache` (and fresh logits / decode-input buffers sized for its batch) to both phases.
        Called once per cache; every later run reuses these bindings."""
        batch = cache.batch
        self.cache = cache
        # Decode inputs live in these arrays; the OrtValues wrap them, so a step only writes numpy.
        self._decode_ids = np.zeros((batch, 1), dtype=np.int64)
        self._logits = np.zeros((batch, self.vocab_size), dtype=self.logits_dtype)
        self._decode_index = np.zeros(batch, dtype=np.int64)  # single mode: logits of the one new token
        self._host_values = {
            "decode_ids": ort.OrtValue.ortvalue_from_numpy(self._decode_ids),
            "past_lens": ort.OrtValue.ortvalue_from_numpy(cache.past_lens),
            "logits": ort.OrtValue.ortvalue_from_numpy(self._logits),
            "decode_index": ort.OrtValue.ortvalue_from_numpy(self._decode_index),
        }
        for phase, session in self.sessions.items():
            binding = session.io_binding()
            order: list[str] = []
            binding.bind_ortvalue_input("past_lens", self._host_values["past_lens"])
            if phase == "decode":
                binding.bind_ortvalue_input("input_ids", self._host_values["decode_ids"])
                if self.session_mode == "single":
                    binding.bind_ortvalue_input("logits_index", self._host_values["decode_index"])
            binding.bind_ortvalue_output("logits", self._host_values["logits"])
            order.append("logits")
            for i in range(cache.num_layers):
                binding.bind_ortvalue_input(f"past_key.{i}", cache.keys[i])
                binding.bind_ortvalue_output(f"present_key.{i}", cache.keys[i])
                binding.bind_ortvalue_input(f"past_value.{i}", cache.values[i])
                binding.bind_ortvalue_output(f"present_value.{i}", cache.values[i])
                order += [f"present_key.{i}", f"present_value.{i}"]
            self._bindings[phase] = binding
            self._output_order[phase] = order

    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("OrtBackend.attach(cache) must be called before running a phase")
        return self.cache

    # -- running --------------------------------------------------------------------------------
    def run_prefill(self, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """input_ids [B, S] int64 (right-padded), logits_index [B] int64 -> logits [B, V] float32.
        Writes positions past_lens[b] + 0..S-1 of every row; the caller advances past_lens."""
        cache = self._require_cache()
        cache.check_fits(input_ids.shape[1])
        binding = self._bindings["prefill"]
        # Prefill runs once per request, so binding fresh input arrays here costs nothing that matters.
        # Held on self until the run: bind_cpu_input wraps the arrays without copying.
        self._prefill_inputs = (
            np.ascontiguousarray(input_ids, dtype=np.int64),
            np.ascontiguousarray(logits_index, dtype=np.int64),
        )
        binding.bind_cpu_input("input_ids", self._prefill_inputs[0])
        binding.bind_cpu_input("logits_index", self._prefill_inputs[1])
        return self._run("prefill")

    def run_decode(self, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray:
        """token_ids [B] -> logits [B, V] float32. Writes position past_lens[b] of every row; the
        capacity is checked for the `running` rows only (finished rows are frozen by the caller)."""
        cache = self._require_cache()
        cache.check_fits(1, running)
        self._decode_ids[:, 0] = token_ids
        return self._run("decode")

    def _run(self, phase: str) -> np.ndarray:
        binding = self._bindings[phase]
        binding.synchronize_inputs()
        self.sessions[phase].run_with_iobinding(binding)
        binding.synchronize_outputs()
        self.runs[phase] += 1
        # float32 logits are returned as a view of the bound buffer: valid until the next run.
        return self._logits if self._logits.dtype == np.float32 else self._logits.astype(np.float32)

    def bound_output_addresses(self, phase: str) -> dict[str, int]:
        """Addresses of the outputs the last run of `phase` wrote to, by output name. get_outputs()
        returns outputs in binding order, not graph order, hence the recorded order."""
        outputs = self._bindings[phase].get_outputs()
        return {name: value.data_ptr() for name, value in zip(self._output_order[phase], outputs, strict=True)}
