"""The few CUDA runtime calls the TensorRT backend needs, through cuda-python (`cuda.bindings`).

Device selection, device buffers, pinned host buffers, one stream, and CUDA graphs. Torch-free, as the
runtime must be.
Every call's status is checked; a failure raises with CUDA's error name.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvforge.core.errors import BackendUnavailableError, KvforgeError


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError as err:
        # The hint names a GPU machine: there is nothing to install on one without (standard TensorRT and
        # the engines run only on a GPU).
        raise BackendUnavailableError(
            "the tensorrt backend (and serving on ort-cuda) runs on an NVIDIA GPU through cuda-python (cuda.bindings), "
            "which is not installed: on a machine with an NVIDIA GPU and its driver, pip install -e '.[trt]' "
            "(TensorRT and cuda-python; -e '.[gpu]' for ort-cuda); `kvforge doctor` shows what runs here"
        ) from err
    return runtime


def check(result: Any) -> Any:
    """cuda-python returns (status, *values): raise on an error status, return the values."""
    cudart = _cudart()
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cudart.cudaError_t.cudaSuccess:
        _, name = cudart.cudaGetErrorName(status)
        raise KvforgeError(f"CUDA error {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_count() -> int:
    cudart = _cudart()
    status, count = cudart.cudaGetDeviceCount()
    return int(count) if status == cudart.cudaError_t.cudaSuccess else 0


def device_info(device_id: int = 0) -> dict[str, str]:
    """The GPU's name and compute capability ("9.0")."""
    cudart = _cudart()
    props = check(cudart.cudaGetDeviceProperties(device_id))
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return {"name": name.rstrip("\0"), "compute_capability": f"{props.major}.{props.minor}"}


def set_device(device_id: int) -> None:
    """Make `device_id` the calling thread's current GPU: CUDA's current device is per thread, and streams,
    allocations and launches go to the current one."""
    check(_cudart().cudaSetDevice(int(device_id)))


_COPY_KINDS = {"device_to_device": "cudaMemcpyDeviceToDevice", "device_to_host": "cudaMemcpyDeviceToHost",
               "host_to_device": "cudaMemcpyHostToDevice"}


def copy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, kind: str) -> None:
    """Copy `height` rows of `width` bytes, rows `src_pitch` apart, to rows `dst_pitch` apart, on the
    legacy default stream (ONNX Runtime's runs have synchronised their own streams by then). A KV
    cache row's positions are one such block per head. Copies from or to the host are done when this
    returns; a device-to-device copy may still run: call `synchronize()` before other streams read it."""
    cudart = _cudart()
    check(cudart.cudaMemcpy2D(int(dst), int(dst_pitch), int(src), int(src_pitch), int(width), int(height),
                              getattr(cudart.cudaMemcpyKind, _COPY_KINDS[kind])))


def synchronize() -> None:
    """Wait for all work on the current GPU."""
    check(_cudart().cudaDeviceSynchronize())


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current GPU."""
    free, total = check(_cudart().cudaMemGetInfo())
    return int(free), int(total)


class Stream:
    """A stream of the GPU current when it is created."""

    def __init__(self) -> None:
        self.handle = check(_cudart().cudaStreamCreate())

    def synchronize(self) -> None:
        check(_cudart().cudaStreamSynchronize(self.handle))

    def __int__(self) -> int:
        return int(self.handle)


class DeviceBuffer:
    """`nbytes` of device memory on the current GPU, zeroed by a memset enqueued on `stream` (so the caller
    must not hand a stream that may be capturing a CUDA graph, and synchronizes before relying on the zeros)."""

    def __init__(self, nbytes: int, stream: Stream) -> None:
        cudart = _cudart()
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(check(cudart.cudaMalloc(self.nbytes)))
        check(cudart.cudaMemsetAsync(self.ptr, 0, self.nbytes, stream.handle))

    def upload(self, array: np.ndarray, stream: Stream) -> None:
        """Copy a host array (pinned or not) to the start of the buffer, on the stream."""
        array = np.ascontiguousarray(array)
        if array.nbytes > self.nbytes:
            raise KvforgeError(f"{array.nbytes} bytes do not fit a {self.nbytes}-byte device buffer")
        cudart = _cudart()
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        check(cudart.cudaMemcpyAsync(self.ptr, array.ctypes.data, array.nbytes, kind, stream.handle))

    def download(self, out: np.ndarray, stream: Stream, offset: int = 0) -> None:
        """Copy `out.nbytes` bytes from `offset` bytes into the buffer to the host array `out`."""
        cudart = _cudart()
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check(cudart.cudaMemcpyAsync(out.ctypes.data, self.ptr + offset, out.nbytes, kind, stream.handle))

    def __del__(self) -> None:
        try:
            _cudart().cudaFree(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class PinnedArray:
    """A numpy array in page-locked host memory (fast asynchronous device-to-host copies)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        dtype = np.dtype(dtype)
        nbytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
        self._ptr = int(check(_cudart().cudaMallocHost(nbytes)))
        raw = (ctypes.c_byte * nbytes).from_address(self._ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def __del__(self) -> None:
        try:
            _cudart().cudaFreeHost(self._ptr)
        except Exception:
            pass


class Graph:
    """A CUDA graph captured from the work `record()` enqueues on `stream`; `launch()` replays it."""

    def __init__(self, stream: Stream, record) -> None:
        cudart = _cudart()
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(cudart.cudaStreamBeginCapture(stream.handle, mode))
        try:
            record()
        finally:
            graph = check(cudart.cudaStreamEndCapture(stream.handle))
        self._graph = graph
        self._exec = check(cudart.cudaGraphInstantiate(graph, 0))

    def launch(self, stream: Stream) -> None:
        check(_cudart().cudaGraphLaunch(self._exec, stream.handle))

    def __del__(self) -> None:
        try:
            cudart = _cudart()
            cudart.cudaGraphExecDestroy(self._exec)
            cudart.cudaGraphDestroy(self._graph)
        except Exception:
            pass
