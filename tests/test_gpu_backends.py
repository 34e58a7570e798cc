"""The GPU backends end to end: ONNX Runtime CUDA, and TensorRT engines from `kvforge build`.

Marked `gpu`; each test skips with the reason where its GPU stack is missing (no machine of this
project has had onnxruntime-gpu or TensorRT, so none of these has run yet). Run on a GPU machine with
`pip install 'kvforge[trt]'` (and onnxruntime-gpu in place of onnxruntime) and `pytest -m gpu`.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")

from kvforge.parity import run_parity  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402

PROMPTS = [[1, 50, 60, 70, 80, 90], [1, 33, 44]]


def _need_ort_cuda() -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu with a CUDA GPU (CUDAExecutionProvider is not available)")


def _need_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("cuda") is None:
        pytest.skip("needs TensorRT and cuda-python (pip install 'kvforge[trt]') on an NVIDIA GPU")
    from kvforge import cuda

    if cuda.device_count() == 0:
        pytest.skip("needs an NVIDIA GPU")


@pytest.mark.parametrize("sessions", ["single", "shared"])
def test_ort_cuda_matches_hf_and_updates_in_place(sessions, hf_folder, exported) -> None:
    _need_ort_cuda()
    folder = exported("llama-tiny", "ort", "fp16")
    report = run_parity(hf_folder("llama-tiny"), folder, new_tokens=32, backend="ort-cuda", sessions=sessions)
    assert report.passed, report.summary()
    gen = Generator(folder, backend="ort-cuda", sessions=sessions)
    stream = gen.stream(PROMPTS, max_new_tokens=8, greedy=True, ignore_eos=True)
    for event in stream:
        addresses = gen.kv_buffer_addresses()
        bound = gen.bound_output_addresses("prefill" if event.step == 0 else "decode")
        assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses


@pytest.mark.parametrize(("target", "dtype", "single"), [("trt", "fp16", False), ("trt", "fp32", True),
                                                        ("onnx", "fp16", False)])
def test_tensorrt_engines_match_hf(target, dtype, single, hf_folder, exported, tmp_path) -> None:
    _need_tensorrt()
    from kvforge.exporter.trt_build import build_engines

    folder = exported("mistral-tiny", target, dtype)
    engine_dir = tmp_path / "engines"
    started = time.perf_counter()
    record = build_engines(folder, engine_dir, max_batch=4, max_seq_len=512, single_engine=single)
    print(f"build {target} {dtype} single={single}: {time.perf_counter() - started:.1f}s, "
          f"weights on GPU {record['weights_on_gpu_bytes']} bytes")
    assert build_engines(folder, engine_dir, max_batch=4, max_seq_len=512, single_engine=single) == record  # reused
    report = run_parity(hf_folder("mistral-tiny"), folder, new_tokens=32, backend="tensorrt",
                        backend_options={"engine_dir": engine_dir})
    print(report.summary())
    assert report.passed, report.summary()
    gen = Generator(folder, backend="tensorrt", engine_dir=engine_dir)
    result = gen.generate(PROMPTS, max_new_tokens=16, greedy=True, ignore_eos=True)
    print(f"trt: ttft {result.ttft_ms:.2f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s")
    addresses = gen.kv_buffer_addresses()
    bound = gen.bound_output_addresses("decode")
    assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
