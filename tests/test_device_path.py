"""ort-cuda's device code path, on the CPU: OrtBackend with `simulate_device` runs exactly the code a CUDA
device runs (step inputs uploaded into bound buffers before every run, decode logits read back from a
bound output buffer, row views bound by address, rows moved by kvforge.core.cuda's 2-D copies) over ONNX
Runtime CPU, whose "device" memory is host memory, and a stand-in of cuda-python's runtime that does
its copies with memmove. Tokens must be the ort-cpu path's, for a batch, speculation, serving with
chunked prefill, row compaction and multi-turn prefix reuse; every row move must go through the copies.

What a real GPU adds (ONNX Runtime copying a host input bound to a device-placed graph input once, at
bind time; CUDA graphs) is checked by benchmarks/gpu_check.py on a GPU, never here.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from kvforge.core import cuda
from kvforge.core.manifest import load_manifest
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.ort_backend import OrtBackend
from kvforge.runtime.sampling import SamplingConfig
from kvforge.runtime.scheduler import Scheduler

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 41)), [7, 300, 12, 12, 8, 90]]


class HostCudart:
    """cuda.bindings.runtime's copy calls over host memory (pointers are host addresses), recording them."""

    cudaError_t = types.SimpleNamespace(cudaSuccess=0)
    cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2,
                                           cudaMemcpyDeviceToDevice=3)
    KINDS = {1: "host_to_device", 2: "device_to_host", 3: "device_to_device"}

    def __init__(self) -> None:
        self.copies: list[str] = []
        self.syncs = 0

    def cudaGetErrorName(self, status):
        return 0, b"cudaErrorFake"

    def cudaSetDevice(self, device):
        return (0,)

    def cudaDeviceSynchronize(self):
        self.syncs += 1
        return (0,)

    def cudaMemcpy2D(self, dst, dpitch, src, spitch, width, height, kind):
        assert width <= dpitch and width <= spitch
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        self.copies.append(self.KINDS[kind])
        return (0,)


class SimulatedDevice(OrtBackend):
    simulate_device = True


@pytest.fixture
def cudart(monkeypatch) -> HostCudart:
    fake = HostCudart()
    monkeypatch.setattr(cuda, "_cudart", lambda: fake)
    return fake


@pytest.fixture(scope="module")
def pair(exported):
    """(ort-cpu Generator, Generator on the simulated device path) of the tiny Llama, fp32."""
    folder = exported("llama-tiny", "ort")
    return Generator(folder), Generator(folder, backend=SimulatedDevice(folder, load_manifest(folder)))


def _greedy(generator: Generator, prompts, n: int = 12, **options):
    return generator.generate(prompts, max_new_tokens=n, greedy=True, ignore_eos=True, **options).tokens


def test_device_path_defaults_and_bindings(pair) -> None:
    cpu, device = pair
    backend = device.backend
    assert backend.on_device and backend.session_mode == "separate" and not backend.cuda_graphs
    slot = backend.allocate(2, 32)
    # The decode step's inputs and logits are the slot's own bound buffers (fixed addresses), never
    # the host arrays the runtime writes: those are uploaded into them before each run.
    backend.prefill(slot, np.array([[1, 2, 3], [4, 0, 0]], np.int64), np.array([2, 0], np.int64))
    slot.cache.past_lens[:] = [3, 1]
    backend.decode(slot, np.array([7, 8], np.int64))
    assert slot.device_values["decode_ids"].numpy()[:, 0].tolist() == [7, 8]
    assert slot.device_values["past_lens"].numpy().tolist() == [3, 1]
    assert backend.bound_output_addresses(slot, "decode")["logits"] == slot.device_values["logits"].data_ptr()


def test_device_path_generates_the_cpu_tokens(pair) -> None:
    cpu, device = pair
    assert _greedy(device, PROMPTS) == _greedy(cpu, PROMPTS)  # a batch of different lengths
    lookup = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]]
    assert _greedy(device, lookup, 16, speculate="prompt-lookup") == _greedy(cpu, lookup, 16)


def test_serving_on_the_device_path_moves_rows_through_cuda_copies(pair, cudart) -> None:
    cpu, device = pair
    scheduler = Scheduler(device, max_batch=4, max_seq_len=96, prefill_chunk=8).start()
    try:
        lengths = [3, 14, 6]
        handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True))
                   for p, n in zip(PROMPTS, lengths, strict=True)]
        served = [h.result()[0] for h in handles]
        assert served == [_greedy(cpu, [p], n)[0] for p, n in zip(PROMPTS, lengths, strict=True)]
        # A second turn: the first turn's rows come back from the prefix store (host copies) and
        # only what follows is prefilled; the answer is still the solo one.
        first = PROMPTS[1] + served[1][:-1]
        follow = first + [served[1][-1], 9, 10]
        tokens, _, done = scheduler.submit(GenerationRequest(follow, 5, SamplingConfig(greedy=True),
                                                             ignore_eos=True)).result()
        assert done.cached_tokens == len(first) and tokens == _greedy(cpu, [follow], 5)[0]
    finally:
        scheduler.close()
    # Every row move went through the device copies: prefill rows into the batch, the compaction
    # of finished rows, snapshots for the prefix store and their restore.
    assert {"device_to_device", "device_to_host", "host_to_device"} <= set(cudart.copies)
    assert cudart.syncs > 0


def test_row_views_bind_the_same_memory(pair, cudart) -> None:
    _, device = pair
    backend = device.backend
    slot = backend.allocate(4, 16)
    view = backend.view_rows(slot, 2)
    assert view.cache.batch == 2 and view.cache.buffer_pointers() == slot.cache.buffer_pointers()
    view.cache.past_lens[1] = 5
    assert slot.cache.past_lens[1] == 5  # one fill level, shared
    rows = [(np.full((2, 3, 16), i, np.float32), np.full((2, 3, 16), -i, np.float32)) for i in range(2)]
    backend.write_rows(slot, 1, rows, 3)
    backend.copy_rows(slot, 1, slot, 3, 3)
    back = backend.read_rows(slot, 3, 3)
    assert [(k.tolist(), v.tolist()) for k, v in back] == [(k.tolist(), v.tolist()) for k, v in rows]
    key, _ = view.cache.read(1)
    assert key.shape[0] == 2 and (key[1, :, :3] == 1).all()
