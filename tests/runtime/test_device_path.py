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
from kvforge.core.errors import InputError
from kvforge.core.manifest import load_manifest
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.backends.ort_backend import OrtBackend
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.scheduler import Scheduler

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


# -- greedy picks on the device (runtime/backends/device_pick.py) ---------------------------------------------
def _count_picks(backend: OrtBackend, monkeypatch) -> list[int]:
    picks = [0]
    run = backend.picker.run

    def counted(*args):
        picks[0] += 1
        return run(*args)

    monkeypatch.setattr(backend.picker, "run", counted)
    return picks


def test_bare_greedy_steps_pick_on_the_device_with_the_host_paths_tokens(pair, monkeypatch) -> None:
    cpu, device = pair
    assert device.backend.device_greedy
    picks = _count_picks(device.backend, monkeypatch)
    assert _greedy(device, PROMPTS) == _greedy(cpu, PROMPTS)
    assert picks[0] == 11  # 12 tokens: the first from the prefill's logits, 11 decode steps picked there
    # A row that needs its logits (logprobs) or a caller keeping them reads them back instead.
    picks[0] = 0
    sampled = device.generate(PROMPTS[:1], max_new_tokens=6, greedy=True, ignore_eos=True, logprobs=2)
    assert sampled.tokens == _greedy(cpu, PROMPTS[:1], 6) and picks[0] == 0
    kept = device.generate(PROMPTS[:1], max_new_tokens=6, greedy=True, ignore_eos=True, keep_logits=True)
    assert picks[0] == 0 and len(kept.logits) == 6


def test_serving_picks_on_the_device_with_solo_tokens(pair, cudart, monkeypatch) -> None:
    cpu, device = pair
    picks = _count_picks(device.backend, monkeypatch)
    scheduler = Scheduler(device, max_batch=4, max_seq_len=96, prefill_chunk=8).start()
    try:
        handles = [scheduler.submit(GenerationRequest(p, 9, SamplingConfig(greedy=True), ignore_eos=True))
                   for p in PROMPTS]
        assert [h.result()[0] for h in handles] == [_greedy(cpu, [p], 9)[0] for p in PROMPTS]
    finally:
        scheduler.close()
    assert picks[0] > 0


def test_device_greedy_off_reads_the_logits_back(exported) -> None:
    folder = exported("llama-tiny", "ort")
    backend = SimulatedDevice(folder, load_manifest(folder), device_greedy=False)
    assert not backend.device_greedy and backend.picker is None
    with pytest.raises(InputError, match="device_greedy is an option of backend 'ort-cuda'"):
        OrtBackend(folder, load_manifest(folder), device_greedy=True)
    with pytest.raises(InputError, match="device_greedy must be True or False"):
        SimulatedDevice(folder, load_manifest(folder), device_greedy="yes")


def pick_model(dtype) -> bytes:
    """What kvforge/data/device_pick_*.onnx must hold: ArgMax and ReduceSum over the last axis."""
    from onnx import TensorProto, helper

    element = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}[np.dtype(dtype)]
    graph = helper.make_graph(
        [helper.make_node("ArgMax", ["scores"], ["token"], axis=-1, keepdims=0),
         helper.make_node("ReduceSum", ["scores", "axes"], ["total"], keepdims=0)],
        "kvforge_device_pick",
        [helper.make_tensor_value_info("scores", element, ["batch", "vocab"])],
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("total", element, ["batch"])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [-1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="kvforge")
    model.ir_version = 9  # what onnxruntime 1.17+ reads
    return model.SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_stored_pick_graphs_are_the_argmax_and_sum_graph(dtype) -> None:
    from kvforge.runtime.backends.device_pick import pick_model_bytes

    # To change them: write pick_model(dtype) to kvforge/data/device_pick_{float16,float32}.onnx.
    assert pick_model_bytes(np.dtype(dtype)) == pick_model(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_pick_graph_is_numpys_argmax_and_flags_nan_rows(dtype) -> None:
    import onnxruntime as ort

    from kvforge.runtime.backends.device_pick import DevicePicker

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(dtype)
    logits[1, [17, 200]] = 9.0  # a tie: the first index, as numpy's argmax (and ONNX's ArgMax) pick
    logits[2, 5] = np.nan
    picker = DevicePicker(np.dtype(dtype), "cpu")
    pick = picker.bind(ort.OrtValue.ortvalue_from_numpy(logits), 4)
    token, total = picker.run(pick)
    expected = logits.argmax(-1)
    assert token[[0, 1, 3]].tolist() == expected[[0, 1, 3]].tolist() and token[1] == 17
    assert np.isnan(total).tolist() == [False, False, True, False]
    logits[2, 5] = 0.0  # the same binding reads the buffer's new contents
    token, total = picker.run(pick)
    assert token.tolist() == logits.argmax(-1).tolist() and not np.isnan(total).any()


def test_a_nan_picked_on_the_device_is_a_numerical_error(pair, monkeypatch) -> None:
    from kvforge.core.errors import NumericalError

    _, device = pair
    run = device.backend.picker.run

    def poisoned(pick):
        token, total = run(pick)
        return token, np.full_like(total, np.nan)

    monkeypatch.setattr(device.backend.picker, "run", poisoned)
    with pytest.raises(NumericalError, match="the model produced NaN logits at step 1"):
        _greedy(device, PROMPTS[:1], 4)


def test_decode_attention_goes_to_the_cuda_providers_decode_session(exported) -> None:
    folder = exported("llama-tiny", "ort")
    auto = SimulatedDevice(folder, load_manifest(folder))
    cuda, options = auto._decode_providers(True)[0]
    assert cuda == "CUDAExecutionProvider" and options["enable_cuda_graph"] == "1" and "sdpa_kernel" not in options
    flash = SimulatedDevice(folder, load_manifest(folder), decode_attention="flash")
    # flash attention first (1), memory-efficient (2) and unfused (16) as fallbacks; cuDNN (8) left out
    assert flash._decode_providers(False)[0][1]["sdpa_kernel"] == "19"
    with pytest.raises(InputError, match="decode_attention must be one of auto, flash, got 'cudnn'"):
        SimulatedDevice(folder, load_manifest(folder), decode_attention="cudnn")
