"""CPU emulation of the `trt` target: its graphs on ONNX Runtime CPU, the plugin node served in Python.

A `trt`-target export carries kvforge's TensorRT plugin node (kvforge.core.contract.PLUGIN) where the other
targets carry an ONNX Runtime or ONNX attention op. Here that node runs as an onnxruntime-extensions
Python op (which is why the node's domain is PLUGIN.onnx_domain, the domain those ops live in;
TensorRT's parser ignores node domains). The op runs, as the emulate backend's `emulation` option says:

- "triton": the Triton kernel TensorRT would run, under the Triton interpreter on CPU tensors (the
  default; needs torch and triton, the `emulate` extra), or
- "reference": the numpy reference (torch-free).

Either one writes the new rows into the cache it is given, as the plugin does in place. The Python op
bridge itself copies its inputs and outputs (onnxruntime-extensions passes numpy copies), so the
runtime's bound buffers end up holding the updated cache but each call moves the whole cache through
Python: the emulation proves the plugin's semantics and the graph around it, not its speed. The
bridge has no float16/bfloat16, so only fp32 `trt` exports can be emulated.

The op is registered once per process, for every session; which implementation serves a call is the
one of the backend running it: `serving(mode)` holds it for the calling thread while that backend's
session runs (ONNX Runtime runs a session's nodes on the thread that called `run`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.contract import (
    ATTENTION_INPUTS,
    ATTENTION_OUTPUTS,
    PAST_LENS,
    PLUGIN,
    AttentionAttrs,
    attention_parameters,
    check_attention_parameters,
)
from kvforge.core.errors import BackendUnavailableError, InputError, KvforgeError
from kvforge.core.targets import Target
from kvforge.runtime.backends.ort_backend import OrtBackend, OrtSlot

MODES = ("triton", "reference")
DEFAULT_MODE = "triton"

_lock = threading.Lock()
_registered: str | None = None  # the custom-ops library path, once the op is registered
_serving = threading.local()  # .mode: the implementation the calling thread's session runs


def resolve_mode(mode: str | None) -> str:
    """The emulation to run: `mode` (None: DEFAULT_MODE), or InputError naming the choices."""
    chosen = DEFAULT_MODE if mode is None else mode
    if chosen not in MODES:
        raise InputError(f"emulation={mode!r} is not an emulation of the plugin; choose one of {', '.join(MODES)}")
    return chosen


def _require(modules: tuple[str, ...], why: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"backend 'emulate' {why} needs {', '.join(missing)}: pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && "
            "pip install -e '.[emulate]'" + (" (or pass emulation='reference' for the torch-free numpy reference)"
                                                if "torch" in missing or "triton" in missing else "")
        )


def check_available(mode: str) -> None:
    """A clear error if what `mode` needs is not installed."""
    _require(("onnxruntime_extensions",), "")
    if mode == "triton":
        _require(("torch", "triton"), "with the Triton kernel")


def _run_triton(q, k, v, past_key, past_value, past_lens, attrs: AttentionAttrs) -> np.ndarray:
    import torch

    from kvforge.plugins import triton_attention

    # CPU tensors: the launcher runs the kernel under the Triton interpreter. from_numpy shares
    # memory, so the kernel's in-place writes land in past_key / past_value.
    out = triton_attention.kv_cache_attention_triton(
        *(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)),
        torch.from_numpy(past_key), torch.from_numpy(past_value), torch.from_numpy(past_lens), attrs,
    )
    return out.numpy()


def _run_reference(q, k, v, past_key, past_value, past_lens, attrs: AttentionAttrs) -> np.ndarray:
    from kvforge.plugins import numpy_reference

    return numpy_reference.kv_cache_attention_(q, k, v, past_key, past_value, past_lens, attrs)


# Each runner looks its implementation up at call time, so tests can spy on which one served a node.
_RUNNERS = {"triton": _run_triton, "reference": _run_reference}


@contextlib.contextmanager
def serving(mode: str) -> Iterator[None]:
    """Plugin nodes run by this thread inside the block are served by `mode`'s implementation."""
    previous = getattr(_serving, "mode", None)
    _serving.mode = mode
    try:
        yield
    finally:
        _serving.mode = previous


def _serve(q, k, v, past_key, past_value, past_lens, **node_attrs):
    mode = getattr(_serving, "mode", None)
    if mode is None:
        raise KvforgeError("the emulated attention plugin ran outside an emulate backend's run; "
                           "run the trt-target graphs through backend 'emulate'")
    # The bridge hands us private copies: update them in place and hand them back as present_*.
    past_key, past_value = np.ascontiguousarray(past_key), np.ascontiguousarray(past_value)
    lens = np.asarray(past_lens, dtype=np.int32)
    out = _RUNNERS[mode](q, k, v, past_key, past_value, lens, AttentionAttrs.from_mapping(node_attrs))
    return out.astype(np.float32), past_key, past_value


for _runner in (_run_triton, _run_reference):
    check_attention_parameters(_runner, attention_parameters(spelled=False))
check_attention_parameters(_serve, ATTENTION_INPUTS)  # the node's attributes come as keywords


def custom_ops_library(mode: str) -> str:
    """Check that `mode` can run, register the plugin op with onnxruntime-extensions (once per process)
    and return the custom-ops library path to register on an ONNX Runtime session."""
    global _registered
    check_available(mode)
    with _lock:
        if _registered is not None:
            return _registered
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

        f32, i32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32
        kinds = {int: PyCustomOpDef.dt_int64, float: PyCustomOpDef.dt_float}
        attrs = {name: kinds[kind] for name, kind in AttentionAttrs.types().items()}
        attrs.update({name: PyCustomOpDef.dt_string for name in PLUGIN.node_attributes()})
        onnx_op(
            op_type=PLUGIN.name,
            inputs=[i32 if name == PAST_LENS else f32 for name in ATTENTION_INPUTS],
            outputs=[f32] * len(ATTENTION_OUTPUTS),
            attrs=attrs,
        )(_serve)
        _registered = get_library_path()
        return _registered


class EmulateBackend(OrtBackend):
    """The `trt` target's graphs on ONNX Runtime CPU, kvforge's plugin node served in Python
    (runtime/backends/emulate.py). Same options as ort-cpu, plus `emulation`: "triton" (the Triton kernel under
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
        target: Target | None = None,
    ) -> None:
        self.emulation = resolve_mode(emulation)
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
        self.custom_ops_library = custom_ops_library(self.emulation)
        super().__init__(folder, manifest, "cpu", device_id, threads, sessions, max_capacity, target=target)
        self.name = "emulate"

    def _run(self, slot: OrtSlot, phase: str) -> np.ndarray:
        # The plugin op is registered once per process: tell it which implementation this backend runs.
        with serving(self.emulation):
            return super()._run(slot, phase)
