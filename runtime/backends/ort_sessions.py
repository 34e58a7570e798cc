"""ONNX Runtime sessions for an export folder: the providers of a device, the options each backend option
becomes, the sessions of each phase (opened from the bytes the manifest's hashes were checked on), and the
checks that each session's IO is what the manifest says. runtime/backends/ort_backend.py runs them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import KV_KINDS, LOGITS, GraphIO, KVLayout, ModelSpec, parse_cache_name
from kvforge.core.errors import BackendUnavailableError, InputError, ManifestError
from kvforge.core.manifest import io_entry, io_names, read_graph
from kvforge.core.targets import Target

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
                f"{available}; install onnxruntime-gpu (pip install -e '.[gpu]') or use backend='ort-cpu'"
            )
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    raise InputError(f"unknown ONNX Runtime device {device!r}; expected one of {DEVICES}")



THREADS_ENV = "KVFORGE_THREADS"


def default_threads() -> int | None:
    """The intra-op threads of a session opened without `threads`: KVFORGE_THREADS where set (a process sharing its
    cores with others, as each of several test workers or replicas on one machine), else ONNX Runtime's own (one per
    physical core)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"{THREADS_ENV}={value!r}: expected a positive number of threads, or unset")
    return int(value)


def open_session(folder: Path, manifest: dict[str, Any], phase: str, providers: list[Any], *, device: str,
                 threads: int | None, spinning: bool, sessions: str,
                 custom_ops_library: str | None = None) -> ort.InferenceSession:
    """`phase`'s session: its graph read from the bytes checked against the manifest's sha256, its
    external weights resolved in the export folder (ONNX Runtime refuses paths leaving it)."""
    options = ort.SessionOptions()
    if custom_ops_library is not None:
        options.register_custom_ops_library(custom_ops_library)
    threads = threads if threads is not None else default_threads()
    if threads is not None:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if sessions == "shared":
        # ORT memory-maps the external weights file, so both sessions read the same page-cache
        # copy. The CPU kernels' prepacking would make a private packed copy per session (two
        # copies of the weights); turning it off keeps one, at some decode speed.
        options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(read_graph(folder, manifest, phase), sess_options=options, providers=providers,
                                disabled_optimizers=CPU_DISABLED_OPTIMIZERS if device == "cpu" else None)


def check_options(threads: Any, spinning: Any, sessions: Any, max_capacity: Any) -> None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InputError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(spinning, bool):
        raise InputError(f"spinning must be True or False, got {spinning!r}")
    if sessions not in SESSION_MODES:
        raise InputError(f"unknown sessions mode {sessions!r}; choose one of {', '.join(SESSION_MODES)}")
    if max_capacity is not None and (isinstance(max_capacity, bool) or not isinstance(max_capacity, int)
                                     or max_capacity < 1):
        raise InputError(f"max_capacity must be a positive integer, got {max_capacity!r}")


def check_device(folder: Path, manifest: dict[str, Any], target: Target, kv: KVLayout, device: str, device_id: int,
                 cuda_graphs: bool | None, sessions: str) -> None:
    """What the device itself rules out: bf16 on the CPU, an fp32 `ort` export on CUDA, CUDA graphs
    without a GPU or without decode.onnx's own session. `target`: the manifest's."""
    if kv.dtype == "bfloat16" and device == "cpu":
        raise InputError(
            f"{folder} is a bf16 export: ONNX Runtime CPU has no bfloat16 kernels, so it cannot run here; "
            "use --backend ort-cuda, or export with --dtype fp16 or fp32"
        )
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise InputError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and device == "cpu":
        raise InputError("cuda_graphs is an option of backend 'ort-cuda' (CUDA graphs need a GPU)")
    if cuda_graphs and sessions == "single":
        raise InputError("cuda_graphs needs decode.onnx in its own session: use sessions='separate' "
                         "('single' runs decode steps through the prefill graph, which cannot be captured)")
    if device == "cuda":
        providers_for(device, device_id)  # no CUDA provider: say so before anything else
        dtype = manifest.get("dtype")
        if dtype not in target.cuda_dtypes:
            raise InputError(
                f"{folder} is an {dtype} export of the {target.name} target: {target.cuda_dtypes_why}; export "
                f"with --dtype {' (or '.join(target.cuda_dtypes)}{')' * (len(target.cuda_dtypes) - 1)} for "
                "--backend ort-cuda"
            )


def feature_dtype(manifest: dict[str, Any]) -> Any:
    """The numpy dtype of a vision-language export's image features (its activations')."""
    return np.float16 if manifest.get("dtype") == "fp16" else np.float32


def check_session_io(manifest: dict[str, Any], kv: KVLayout, phase: str, session: ort.InferenceSession) -> None:
    """The session's IO names, dtypes and fixed dimensions are the manifest's (ManifestError otherwise)."""
    want = GraphIO.of_manifest(phase, kv, manifest)
    file = manifest["graphs"][phase]["file"]
    have_in = [node.name for node in session.get_inputs()]
    have_out = [node.name for node in session.get_outputs()]
    if sorted(have_in) != sorted(want.inputs) or sorted(have_out) != sorted(want.outputs):
        raise ManifestError(
            f"{file} has inputs {have_in} and outputs {have_out}, "
            f"which disagree with its manifest; the folder was modified, re-run the export"
        )
    # Dtypes and fixed dimensions the manifest states must be the graph's: the runtime sizes its
    # buffers from the manifest, so a mismatch would only show as an ONNX Runtime error mid-run.
    vocab = ModelSpec.from_manifest(manifest).vocab_size
    for node in list(session.get_inputs()) + list(session.get_outputs()):
        entry = io_entry(manifest, phase, node.name) or {}
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
        cache = parse_cache_name(node.name)
        if cache is not None:
            _, kind, layer = cache
            if (layer, kind) not in kv.buffers():
                raise ManifestError(f"{file}: {node.name} is not a buffer of the manifest's kv_cache; re-run the export")
            wanted = [None, *kv.buffer_shape(1, 1, layer, kind)[1:]]
            if kind in KV_KINDS:
                wanted[2] = None  # the capacity is the runtime's
            if dtype != kv.buffer_dtype(layer, kind):
                raise ManifestError(
                    f"{file}: {node.name} is {dtype} but the manifest's KV cache says {kv.buffer_dtype(layer, kind)}; "
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

def logits_dtype(manifest: dict[str, Any]) -> type:
    """The numpy type of the logits the graphs return."""
    entry = io_entry(manifest, "decode", LOGITS)
    if entry is None or LOGITS not in io_names(manifest["graphs"]["decode"], "outputs"):
        raise ManifestError(f"the manifest's decode graph has no {LOGITS!r} output; re-run the export")
    dtype = entry.get("dtype", "float32")
    if dtype not in LOGITS_DTYPES:
        raise ManifestError(f"logits dtype {dtype!r} is not supported; expected {sorted(LOGITS_DTYPES)}")
    return LOGITS_DTYPES[dtype]


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
