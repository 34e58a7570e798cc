"""kvforge/core/cuda.py (what the TensorRT backend allocates, copies and replays with) on a real GPU.

Marked `gpu`: skips without cuda-python or a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("cuda.bindings")

from kvforge.core import cuda  # noqa: E402

if cuda.device_count() == 0:
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_device_info_names_the_gpu() -> None:
    info = cuda.device_info(0)
    major, minor = info["compute_capability"].split(".")
    assert info["name"] and int(major) >= 7 and minor.isdigit()


def test_upload_download_round_trip_and_zeroed_allocation() -> None:
    stream = cuda.Stream()
    data = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float16)
    buffer = cuda.DeviceBuffer(data.nbytes + 64, stream)
    zeros = np.full(data.shape, 1, dtype=np.float16)
    buffer.download(zeros, stream)
    stream.synchronize()
    assert not zeros.any()  # allocations are zeroed
    buffer.upload(data, stream)
    pinned = cuda.PinnedArray(data.shape, np.float16)
    buffer.download(pinned.array, stream)
    stream.synchronize()
    assert np.array_equal(pinned.array, data)


def test_a_captured_graph_replays_with_new_inputs_at_the_same_addresses() -> None:
    # The decode-step pattern: upload inputs, then replay a graph that reads them from fixed addresses.
    from cuda.bindings import runtime as cudart

    stream = cuda.Stream()
    src, dst = cuda.DeviceBuffer(64, stream), cuda.DeviceBuffer(64, stream)
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    graph = cuda.Graph(stream, lambda: cuda.check(cudart.cudaMemcpyAsync(dst.ptr, src.ptr, 64, kind, stream.handle)))
    out = np.empty(16, dtype=np.int32)
    for step in range(3):
        src.upload(np.arange(16, dtype=np.int32) + step, stream)
        graph.launch(stream)
        dst.download(out, stream)
        stream.synchronize()
        assert out.tolist() == list(range(step, step + 16))


def test_errors_raise_with_cudas_name() -> None:
    from cuda.bindings import runtime as cudart

    from kvforge.core.errors import KvforgeError

    with pytest.raises(KvforgeError, match="CUDA error cudaError"):
        cuda.check(cudart.cudaSetDevice(10_000))


def test_set_device_makes_the_gpu_current_in_this_thread() -> None:
    from cuda.bindings import runtime as cudart

    last = cuda.device_count() - 1
    cuda.set_device(last)
    assert cuda.check(cudart.cudaGetDevice()) == last
    cuda.set_device(0)
