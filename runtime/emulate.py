"""CPU emulation of the `trt` target: its graphs on ONNX Runtime CPU, the plugin node served in Python.

A `trt`-target export carries kvforge's TensorRT plugin node (`KVCacheAttention`, plugin_namespace
"kvforge") where the other targets carry an ONNX Runtime or ONNX attention op. Here that node runs as
an onnxruntime-extensions Python op (which is why the node's domain is `ai.onnx.contrib`, the domain
those ops live in; TensorRT's parser ignores node domains). The op runs:

- the Triton kernel TensorRT would run, under the Triton interpreter on CPU tensors (default; needs
  torch and triton, the `emulate` extra), or
- the numpy reference when KVFORGE_EMULATE=reference (torch-free).

Either one writes the new rows into the cache it is given, as the plugin does in place. The Python op
bridge itself copies its inputs and outputs (onnxruntime-extensions passes numpy copies), so the
runtime's bound buffers end up holding the updated cache but each call moves the whole cache through
Python: the emulation proves the plugin's semantics and the graph around it, not its speed. The
bridge has no float16/bfloat16, so only fp32 `trt` exports can be emulated.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

import numpy as np

from kvforge.errors import BackendUnavailableError

OP_TYPE = "KVCacheAttention"
OP_DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' Python ops are registered in this domain
PLUGIN_NAMESPACE = "kvforge"
PLUGIN_VERSION = "1"
MODES = ("triton", "reference")
ENV = "KVFORGE_EMULATE"

_lock = threading.Lock()
_registered: str | None = None  # the custom-ops library path, once the op is registered


def emulation_mode() -> str:
    mode = os.environ.get(ENV, "triton").strip().lower() or "triton"
    if mode not in MODES:
        raise BackendUnavailableError(f"{ENV}={mode!r} is not a mode; choose one of {', '.join(MODES)}")
    return mode


def _require(modules: tuple[str, ...], why: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"backend 'emulate' {why} needs {', '.join(missing)}: pip install torch==2.13.0 && "
            "pip install 'kvforge[emulate]'" + (f" (or set {ENV}=reference for the torch-free numpy reference)"
                                                if "torch" in missing or "triton" in missing else "")
        )


# Calls of the plugin op per mode (tests check which implementation served the node).
CALLS = {mode: 0 for mode in MODES}


@functools.cache
def _attention(mode: str):
    """The function that serves the plugin node: (q, k, v, past_key, past_value, past_lens, attrs) ->
    out, writing the new rows into past_key / past_value."""
    if mode == "reference":
        from kvforge.plugins.numpy_reference import kv_cache_attention_

        return kv_cache_attention_

    import torch

    from kvforge.plugins.triton_attention import kv_cache_attention_triton

    def run(q, k, v, past_key, past_value, past_lens, heads, kv_heads, scale, softcap, window):
        # CPU tensors: the launcher runs the kernel under the Triton interpreter. from_numpy shares
        # memory, so the kernel's in-place writes land in past_key / past_value.
        out = kv_cache_attention_triton(
            *(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)),
            torch.from_numpy(past_key), torch.from_numpy(past_value), torch.from_numpy(past_lens),
            heads, kv_heads, scale, softcap=softcap, sliding_window=window,
        )
        return out.numpy()

    return run


def check_available() -> str:
    """The current mode, after checking that what it needs is installed (a clear error if not)."""
    mode = emulation_mode()
    _require(("onnxruntime_extensions",), "")
    if mode == "triton":
        _require(("torch", "triton"), "with the Triton kernel")
    return mode


def custom_ops_library() -> str:
    """Register the plugin op with onnxruntime-extensions (once per process) and return the custom-ops
    library path to register on an ONNX Runtime session. The mode (KVFORGE_EMULATE) is read at each
    call of the op, so one process can run both."""
    global _registered
    check_available()
    with _lock:
        if _registered is not None:
            return _registered
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

        f32, i32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64

        @onnx_op(
            op_type=OP_TYPE,
            inputs=[f32, f32, f32, f32, f32, i32],
            outputs=[f32, f32, f32],
            attrs={"num_heads": i64, "kv_num_heads": i64, "scale": PyCustomOpDef.dt_float,
                   "softcap": PyCustomOpDef.dt_float, "sliding_window": i64,
                   "plugin_namespace": PyCustomOpDef.dt_string, "plugin_version": PyCustomOpDef.dt_string},
        )
        def kvforge_plugin(q, k, v, past_key, past_value, past_lens, **attrs):
            mode = emulation_mode()
            CALLS[mode] += 1
            # The bridge hands us private copies: update them in place and hand them back as present_*.
            past_key, past_value = np.ascontiguousarray(past_key), np.ascontiguousarray(past_value)
            out = _attention(mode)(
                q, k, v, past_key, past_value, np.asarray(past_lens, dtype=np.int32),
                int(attrs["num_heads"]), int(attrs["kv_num_heads"]), float(attrs["scale"]),
                float(attrs.get("softcap", 0.0)), int(attrs.get("sliding_window", 0)),
            )
            return out.astype(np.float32), past_key, past_value

        _registered = get_library_path()
        return _registered
