"""The TensorRT backend's CUDA discipline, on the CPU: runtime/backends/trt_backend.py and kvforge/core/cuda.py over a
stand-in of cuda-python's runtime API and of TensorRT's runtime that record what reaches each stream.

What the stand-ins flag (as `FakeCuda.violations`), each a way the real pair goes wrong:
- work enqueued on a stream while it captures a CUDA graph (a memset or copy is recorded into that graph;
  a synchronize invalidates the capture);
- a second CUDA graph captured on an execution context that already holds one, and a graph replayed after
  its context was rebound to other shapes or addresses (TensorRT: one context per captured graph);
- a capture not preceded by a warm-up run of the same context with the same bindings and a stream sync
  (TensorRT applies deferred updates on an enqueue, which must not happen inside a capture);
- stream work from a thread whose current device is not the stream's (CUDA's current device is per thread).

What the GPU really computes is not modelled (tests/engines/test_gpu_backends.py runs that on a GPU).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import sys
import threading
import types

import numpy as np
import pytest

from kvforge.core import cuda
from kvforge.core.engine_plan import (
    ENGINE_DIR_NAME,
    ENGINES_MANIFEST,
    engines_manifest,
    resolve_build_options,
    sealed,
)
from kvforge.core.errors import InputError
from kvforge.core.manifest import file_record
from kvforge.core.targets import get_target

TRT_VERSION = "10.15.1"
SUCCESS = 0


class FakeCuda:
    """cuda.bindings.runtime, as far as kvforge/core/cuda.py uses it, recording every stream operation."""

    cudaError_t = types.SimpleNamespace(cudaSuccess=SUCCESS)
    cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2,
                                           cudaMemcpyDeviceToDevice=3)
    cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeGlobal=0, cudaStreamCaptureModeThreadLocal=1)

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._ids = itertools.count(1)
        self._thread = threading.local()
        self._mutex = threading.Lock()
        self.streams: dict[int, dict] = {}  # handle -> {"device", "capture": None or {...}}
        self.events: list[dict] = []
        self.violations: list[str] = []
        self.malloc_devices: list[int] = []
        self.host: dict[int, ctypes.Array] = {}
        self.graphs: dict[int, list[dict]] = {}  # exec handle -> captured (context, snapshot)
        self.live_graphs: dict[int, int] = {}  # context id -> graphs captured on it
        self.on_capture_execute = None  # a test's hook, called when an execute is captured

    # -- devices -------------------------------------------------------------------------------
    def current(self) -> int:
        return getattr(self._thread, "device", 0)

    def cudaGetErrorName(self, status):
        return SUCCESS, b"cudaErrorFake"

    def cudaGetDeviceCount(self):
        return SUCCESS, self.devices

    def cudaGetDeviceProperties(self, device):
        return SUCCESS, types.SimpleNamespace(name=b"Fake GPU", major=9, minor=0)

    def cudaSetDevice(self, device):
        assert 0 <= device < self.devices
        self._thread.device = int(device)
        return (SUCCESS,)

    def cudaGetDevice(self):
        return SUCCESS, self.current()

    # -- memory --------------------------------------------------------------------------------
    def cudaMalloc(self, nbytes):
        self.malloc_devices.append(self.current())
        return SUCCESS, next(self._ids) << 20

    def cudaFree(self, ptr):
        return (SUCCESS,)

    def cudaMallocHost(self, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        self.host[ctypes.addressof(buffer)] = buffer
        return SUCCESS, ctypes.addressof(buffer)

    def cudaFreeHost(self, ptr):
        self.host.pop(ptr, None)
        return (SUCCESS,)

    # -- streams -------------------------------------------------------------------------------
    def cudaStreamCreate(self):
        handle = next(self._ids)
        self.streams[handle] = {"device": self.current(), "capture": None}
        return SUCCESS, handle

    def enqueue(self, op: str, stream: int, **info) -> None:
        with self._mutex:
            state = self.streams[int(stream)]
            if state["device"] != self.current():
                self.violations.append(f"{op} on a device-{state['device']} stream from a thread whose "
                                       f"current device is {self.current()}")
            capture = state["capture"]
            if capture is not None and op != "execute":
                self.violations.append(f"{op} enqueued on stream {stream} while it captures a CUDA graph")
            event = {"op": op, "stream": int(stream), **info}
            (capture["ops"] if capture is not None else self.events).append(event)
        if capture is not None and op == "execute" and self.on_capture_execute is not None:
            self.on_capture_execute()

    def cudaStreamSynchronize(self, stream):
        self.enqueue("sync", stream)
        return (SUCCESS,)

    def cudaMemsetAsync(self, ptr, value, nbytes, stream):
        self.enqueue("memset", stream)
        return (SUCCESS,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        self.enqueue("copy", stream)
        return (SUCCESS,)

    def cudaMemcpy2D(self, dst, dpitch, src, spitch, width, height, kind):
        # The legacy default stream: work on it while any stream captures breaks that capture.
        with self._mutex:
            if any(state["capture"] is not None for state in self.streams.values()):
                self.violations.append("a copy on the default stream while a stream captures a CUDA graph")
            self.events.append({"op": "copy_2d", "stream": 0, "dst": int(dst), "dpitch": int(dpitch),
                                "src": int(src), "spitch": int(spitch), "width": int(width),
                                "height": int(height), "kind": kind})
        return (SUCCESS,)

    def cudaDeviceSynchronize(self):
        with self._mutex:
            self.events.append({"op": "device_sync", "stream": 0})
        return (SUCCESS,)

    # -- graphs --------------------------------------------------------------------------------
    def cudaStreamBeginCapture(self, stream, mode):
        with self._mutex:
            self.streams[int(stream)]["capture"] = {"ops": [], "before": list(self.events)}
        return (SUCCESS,)

    def cudaStreamEndCapture(self, stream):
        with self._mutex:
            state = self.streams[int(stream)]
            capture, state["capture"] = state["capture"], None
        executes = [event for event in capture["ops"] if event["op"] == "execute"]
        for event in executes:
            context = event["context"]
            if self.live_graphs.get(id(context)):
                self.violations.append("a second CUDA graph captured on one execution context")
            self.live_graphs[id(context)] = self.live_graphs.get(id(context), 0) + 1
            mine = [e for e in capture["before"] if e["stream"] == int(stream)]
            runs = [i for i, e in enumerate(mine) if e["op"] == "execute"]
            warm = runs and mine[runs[-1]]["context"] is context and mine[runs[-1]]["state"] == event["state"]
            if not (warm and any(e["op"] == "sync" for e in mine[runs[-1] + 1:])):
                self.violations.append("capture without a warm-up run of the same context and a sync before it")
        graph = next(self._ids)
        self.graphs[graph] = executes
        return SUCCESS, graph

    def cudaGraphInstantiate(self, graph, flags):
        return SUCCESS, graph

    def cudaGraphLaunch(self, graph, stream):
        self.enqueue("graph", stream)
        for event in self.graphs[graph]:
            if event["context"].state() != event["state"]:
                self.violations.append("a graph replayed after its execution context was rebound")
        return (SUCCESS,)

    def cudaGraphExecDestroy(self, graph):
        return (SUCCESS,)

    def cudaGraphDestroy(self, graph):
        return (SUCCESS,)


class FakeContext:
    """TensorRT's IExecutionContext: profile, shapes and addresses; execute enqueues on the stream."""

    def __init__(self, engine: FakeEngine, fake: FakeCuda) -> None:
        self.engine, self.fake = engine, fake
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def state(self) -> tuple:
        return self.profile, tuple(sorted(self.shapes.items())), tuple(sorted(self.addresses.items()))

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        assert 0 <= index < self.engine.num_profiles
        self.profile = int(index)
        self.shapes.clear()  # TensorRT: shapes must be set again after a profile switch
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self.addresses[name]

    def execute_async_v3(self, stream: int) -> bool:
        self.fake.enqueue("execute", stream, context=self, state=self.state())
        return True


class FakeEngine:
    def __init__(self, data: bytes, fake: FakeCuda) -> None:
        self.name, self.fake = data.decode(), fake
        self.num_profiles = 2 if self.name == "prefill.engine single" else 1
        self.contexts: list[FakeContext] = []

    def create_execution_context(self) -> FakeContext:
        context = FakeContext(self, self.fake)
        self.contexts.append(context)
        return context


def fake_tensorrt(fake: FakeCuda) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = TRT_VERSION

    class Logger:
        WARNING = 2

        def __init__(self, severity: int = 2) -> None:
            pass

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            self.engines: list[FakeEngine] = []

        def deserialize_cuda_engine(self, data: bytes) -> FakeEngine:
            engine = FakeEngine(bytes(data), fake)
            self.engines.append(engine)
            return engine

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt


def _manifest(layers: int = 2, max_capacity: int = 256, target: str = "trt") -> dict:
    def io(phase: str) -> list[dict]:
        names = ["input_ids", "past_lens"] + (["logits_index"] if phase == "prefill" else [])
        names += [f"past_{k}.{i}" for i in range(layers) for k in ("key", "value")]
        return [{"name": n} for n in names]

    return {
        "target": target, "dtype": "fp16",
        "model": {"vocab_size": 64, "num_heads": 4},
        "kv_cache": {"num_layers": layers, "num_kv_heads": 2, "head_dim": 16, "max_capacity": max_capacity,
                     "dtype": "float16"},
        "graphs": {"prefill": {"inputs": io("prefill")}, "decode": {"inputs": io("decode")}},
        "files": {"prefill.onnx": {"sha256": "a", "bytes": 1}, "decode.onnx": {"sha256": "b", "bytes": 1}},
    }


@pytest.fixture
def make_backend(monkeypatch, tmp_path):
    """make_backend(devices=1, device_id=0, single_engine=False) -> (TrtBackend, FakeCuda) over stand-ins."""

    def make(devices: int = 1, device_id: int = 0, single_engine: bool = False, target: str = "trt"):
        from kvforge.plugins import trt_plugin

        fake = FakeCuda(devices)
        monkeypatch.setattr(trt_plugin, "register", lambda **options: None)  # the plugin's own tests cover it
        monkeypatch.setattr(cuda, "_cudart", lambda: fake)
        monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(fake))
        folder = tmp_path / f"export-{single_engine}-{target}"
        engine_dir = folder / ENGINE_DIR_NAME
        engine_dir.mkdir(parents=True)
        manifest = _manifest(target=target)
        (folder / "kvforge.json").write_text(json.dumps(manifest))
        options = resolve_build_options(manifest, get_target(target), max_batch=2, max_seq_len=256, single_engine=single_engine)
        names = ["prefill.engine"] if single_engine else ["prefill.engine", "decode.engine"]
        for name in names:
            (engine_dir / name).write_bytes(f"{name} single".encode() if single_engine else name.encode())
        files = {name: file_record(engine_dir / name) for name in names}
        record = engines_manifest(folder, manifest, get_target(target), options, "key", {"flavor": "tensorrt", "version": TRT_VERSION},
                                  {"name": "Fake GPU", "compute_capability": "9.0"}, files, 0.0, "test")
        (engine_dir / ENGINES_MANIFEST).write_text(json.dumps(record))
        from kvforge.runtime.backends.trt_backend import TrtBackend

        return TrtBackend(folder, manifest, device_id=device_id), fake

    return make


def _graph_keys(slots) -> list[tuple[int, int]]:
    """The (batch, capacity) of every slot that holds a captured decode graph."""
    from kvforge.core.engine_plan import graph_key

    return [graph_key(s.cache.batch, s.cache.capacity) for s in slots if s.graph is not None]


def _steps(backend, slot, decodes: int) -> None:
    batch = slot.cache.batch
    backend.prefill(slot, np.ones((batch, 4), np.int64), np.full(batch, 3))
    slot.cache.past_lens[:] = 4
    for _ in range(decodes):
        backend.decode(slot, np.ones(batch, np.int64))
        slot.cache.past_lens += 1


@pytest.mark.parametrize("call", ["allocate", "read_kv"])
def test_nothing_reaches_the_stream_while_another_slot_captures(make_backend, call) -> None:
    backend, fake = make_backend()
    capturing, other_done = threading.Event(), threading.Event()

    def hold_the_capture() -> None:
        capturing.set()
        other_done.wait(timeout=0.5)  # long enough for an unguarded call to slip in; a guarded one waits

    first, second = backend.allocate(1, 64), backend.allocate(2, 128)
    _steps(backend, second, 1)
    fake.on_capture_execute = hold_the_capture
    worker = threading.Thread(target=_steps, args=(backend, first, 2))  # its second decode step captures
    worker.start()
    assert capturing.wait(timeout=10)
    if call == "allocate":
        backend.allocate(1, 32)
    else:
        backend.read_kv(second, 0)
    other_done.set()
    worker.join(timeout=10)
    assert _graph_keys([first]) == [(1, 64)]
    assert fake.violations == []


@pytest.mark.parametrize("single_engine", [False, True], ids=["two-engines", "single-engine"])
def test_each_captured_slot_has_its_own_warmed_up_decode_context(make_backend, single_engine) -> None:
    backend, fake = make_backend(single_engine=single_engine)
    slots = [backend.allocate(1, 64), backend.allocate(2, 128)]
    for slot in slots:
        _steps(backend, slot, 2)  # the second decode step is captured
    for _ in range(2):  # replays, interleaved with the other slot's
        for slot in slots:
            backend.decode(slot, np.ones(slot.cache.batch, np.int64))
            slot.cache.past_lens += 1
    assert _graph_keys(slots) == [(1, 64), (2, 128)]
    assert fake.violations == []
    captured = [event["context"] for graph in fake.graphs.values() for event in graph]
    assert len(captured) == 2 and captured[0] is not captured[1]
    decode_profile = 1 if single_engine else 0
    assert all(context.profile == decode_profile for context in captured)
    assert all(context.engine.name.startswith("prefill" if single_engine else "decode") for context in captured)


def test_the_chosen_gpu_is_current_in_every_thread_that_calls_in(make_backend) -> None:
    backend, fake = make_backend(devices=2, device_id=1)
    slot_box = []

    def serve() -> None:  # a fresh thread's current device is 0 until something selects another
        slot = backend.allocate(2, 64)
        _steps(backend, slot, 3)
        backend.read_kv(slot, 1)
        slot_box.append(slot)

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join(timeout=10)
    assert slot_box and _graph_keys(slot_box) == [(2, 64)]
    assert [state["device"] for state in fake.streams.values()] == [1]
    assert set(fake.malloc_devices) == {1}
    assert fake.violations == []


def test_a_device_id_beyond_the_gpus_is_refused(make_backend) -> None:
    from kvforge.core.errors import InputError

    with pytest.raises(InputError, match="device_id 2 but CUDA reports 2 GPUs"):
        make_backend(devices=2, device_id=2)


def test_a_machine_without_a_gpu_is_named_with_the_backends_name(make_backend) -> None:
    from kvforge.core.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"^the tensorrt backend needs an NVIDIA GPU; CUDA reports none "
                                                      r"\(`kvforge doctor` shows what runs here\)$"):
        make_backend(devices=0)


def test_the_stand_ins_flag_what_they_model() -> None:
    # Each check can fire: the tests above pass only because the backend avoids these.
    fake = FakeCuda(devices=2)
    _, stream = fake.cudaStreamCreate()
    engine = FakeEngine(b"decode.engine", fake)
    context = engine.create_execution_context()
    fake.cudaStreamBeginCapture(stream, 1)
    context.execute_async_v3(stream)
    fake.cudaMemsetAsync(1, 0, 8, stream)
    fake.cudaStreamSynchronize(stream)
    _, graph = fake.cudaStreamEndCapture(stream)
    fake.cudaStreamBeginCapture(stream, 1)
    context.execute_async_v3(stream)
    fake.cudaStreamEndCapture(stream)
    context.set_input_shape("input_ids", (1, 1))
    fake.cudaGraphLaunch(graph, stream)
    fake.cudaSetDevice(1)
    fake.cudaStreamSynchronize(stream)
    assert fake.violations == [
        "memset enqueued on stream 1 while it captures a CUDA graph",
        "sync enqueued on stream 1 while it captures a CUDA graph",
        "capture without a warm-up run of the same context and a sync before it",
        "a second CUDA graph captured on one execution context",
        "capture without a warm-up run of the same context and a sync before it",
        "a graph replayed after its execution context was rebound",
        "sync on a device-0 stream from a thread whose current device is 1",
    ]


def test_onnx_target_engines_allocate_every_slot_at_their_fixed_capacity(make_backend) -> None:
    # TensorRT's KV-cache-update layer fixes the capacity at build time: one bucket, --max-seq-len.
    backend, _fake = make_backend(target="onnx")
    assert backend.limits.capacity_buckets == (256,)
    slot = backend.allocate(1, 64)
    assert slot.cache.capacity == 256 and slot.buffers["key.0"].nbytes == 2 * 256 * 16 * 2
    _steps(backend, slot, 2)
    assert _graph_keys([slot]) == [(1, 256)]


def test_row_operations_copy_on_the_device_with_the_cache_geometry(make_backend) -> None:
    backend, fake = make_backend()
    base = backend.allocate(2, 64)  # fp16, 2 KV heads, head_dim 16: 32 bytes a position, 2 KiB a head
    _steps(backend, base, 3)
    view = backend.view_rows(base, 1)
    assert view.cache.batch == 1 and view.cache.capacity == 64
    assert backend.kv_addresses(view) == backend.kv_addresses(base)  # the same KV memory
    assert view.buffers["past_lens"] is not base.buffers["past_lens"]  # its own step buffers
    view.cache.past_lens[0] = 9
    assert base.cache.past_lens[0] == 9  # one fill level
    _steps(backend, view, 3)  # the view captures a graph of its own, cleanly
    fake.events.clear()
    backend.copy_rows(base, 1, base, 0, 5)
    copies = [e for e in fake.events if e["op"] == "copy_2d"]
    key0 = backend.kv_addresses(base)["past_key.0"]
    assert len(copies) == 4 and copies[0]["kind"] == fake.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    assert (copies[0]["src"], copies[0]["dst"]) == (key0 + 2 * 2048, key0)  # row 1 -> row 0
    assert (copies[0]["width"], copies[0]["height"], copies[0]["spitch"]) == (5 * 32, 2, 2048)
    assert fake.events[-1]["op"] == "device_sync"  # before the stream's next run reads the rows
    rows = backend.read_rows(base, 1, 5)
    assert [k.shape for k, _ in rows] == [(2, 5, 16), (2, 5, 16)] and rows[0][0].dtype == np.float16
    backend.write_rows(base, 0, rows, 5)
    with pytest.raises(InputError, match="do not fit"):
        backend.write_rows(base, 0, [(k[:1], v) for k, v in rows], 5)
    with pytest.raises(InputError, match="outside the cache's 2 rows"):
        backend.copy_rows(base, 2, base, 0, 1)
    assert fake.violations == []


def test_rtx_engines_on_a_gpu_they_cannot_run_are_refused_before_loading(make_backend, monkeypatch) -> None:
    backend, fake = make_backend()  # engines.json says standard TensorRT on a 9.0 GPU: that loads
    assert backend.name == "tensorrt"
    from kvforge.core import tensorrt_flavor
    from kvforge.core.errors import BackendUnavailableError
    from kvforge.runtime.backends.trt_backend import TrtBackend

    record_path = backend.engine_dir / ENGINES_MANIFEST
    record = json.loads(record_path.read_text())
    record["tensorrt"] = {"flavor": "tensorrt-rtx", "version": "1.7.1.116"}
    record_path.write_text(json.dumps(sealed(record)))  # as `kvforge build` with TensorRT-RTX writes it
    rtx = types.ModuleType("tensorrt_rtx")
    rtx.__version__ = "1.7.1.116"
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", rtx)
    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: ["tensorrt", "tensorrt-rtx"])
    loaded: list[bytes] = []
    rtx.Runtime = lambda logger: loaded.append(b"runtime")  # never reached
    with pytest.raises(BackendUnavailableError) as err:
        TrtBackend(backend.folder, backend.manifest, engine_dir=backend.engine_dir)
    message = str(err.value)
    assert "Fake GPU (compute capability 9.0)" in message and "--backend ort-cuda" in message
    assert "rebuild" not in message.replace("no rebuild", "") and loaded == []


def _reload(backend):
    from kvforge.runtime.backends.trt_backend import TrtBackend

    return TrtBackend(backend.folder, backend.manifest, engine_dir=backend.engine_dir)


def test_an_engine_that_does_not_match_engines_json_is_refused_before_loading(make_backend) -> None:
    from kvforge.core.errors import ManifestError

    backend, _fake = make_backend()
    engine = backend.engine_dir / "decode.engine"
    engine.write_bytes(b"X" + engine.read_bytes()[1:])  # same size: only the sha256 tells
    with pytest.raises(ManifestError, match=r"decode.engine does not match its sha256 in engines.json.*kvforge build"):
        _reload(backend)


def test_an_engine_that_is_a_symbolic_link_is_refused(make_backend) -> None:
    from kvforge.core.errors import ManifestError

    backend, _fake = make_backend()
    engine = backend.engine_dir / "decode.engine"
    copy = backend.engine_dir / "copy.engine"
    engine.rename(copy)
    engine.symlink_to(copy.name)  # the same bytes, inside the folder, but not what kvforge build wrote
    with pytest.raises(ManifestError, match=r"decode.engine is a symbolic link.*kvforge build"):
        _reload(backend)


def test_an_edited_engines_json_is_refused(make_backend) -> None:
    from kvforge.core.errors import ManifestError

    backend, _fake = make_backend()
    path = backend.engine_dir / ENGINES_MANIFEST
    record = json.loads(path.read_text())
    record["options"]["max_batch"] = 64  # more rows than the engines were built for
    path.write_text(json.dumps(record))
    with pytest.raises(ManifestError, match=r"engines.json was modified after `kvforge build` wrote it"):
        _reload(backend)
