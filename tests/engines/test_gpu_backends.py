"""The GPU backends end to end: ONNX Runtime CUDA, and TensorRT engines from `kvforge build`.

Marked `gpu`; each test skips with the reason where its GPU stack is missing. Run on a GPU machine with
onnxruntime-gpu in place of onnxruntime (and `pip install -e '.[trt]'` for the TensorRT ones) and
`pytest -m gpu`. The ort-cuda checks here are what benchmarks/gpu_check.py ran on an H100 (2026-11-26:
every family's parity, CUDA-graph replay = plain runs, in place, continuation prefills, serving); the
TensorRT ones have never run (TensorRT-RTX does not run on H100/H200, standard TensorRT was not at hand).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")

from kvforge.models.recipes import FAMILY_RECIPES  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.drivers import inspection  # noqa: E402
from kvforge.tools.parity import run_parity  # noqa: E402

PROMPTS = [[1, 50, 60, 70, 80, 90], [1, 33, 44]]


def _need_ort_cuda() -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu with a CUDA GPU (CUDAExecutionProvider is not available)")


def _need_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("cuda") is None:
        pytest.skip("needs TensorRT and cuda-python (pip install -e '.[trt]') on an NVIDIA GPU")
    from kvforge.core import cuda

    if cuda.device_count() == 0:
        pytest.skip("needs an NVIDIA GPU")


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_ort_cuda_matches_hf_for_every_family(recipe, hf_folder, exported) -> None:
    _need_ort_cuda()
    folder = exported(recipe, "ort", "fp16")
    report = run_parity(hf_folder(recipe), folder, new_tokens=32, backend="ort-cuda", perplexity_tokens=512)
    assert report.passed, report.summary()
    # CUDA-graph replay (the default) gives the tokens of plain runs.
    plain = Generator(folder, backend="ort-cuda", cuda_graphs=False)
    for prompt in report.prompts:
        ids = plain.tokenizer.encode(prompt.prompt)
        assert plain.generate([ids], max_new_tokens=32, greedy=True, ignore_eos=True).tokens[0] == prompt.export_tokens


@pytest.mark.parametrize("options", [{}, {"cuda_graphs": False}, {"sessions": "single"}])
def test_ort_cuda_updates_in_place_and_continues_prefills(options, hf_folder, exported) -> None:
    _need_ort_cuda()
    folder = exported("llama-tiny", "ort", "fp16")
    gen = Generator(folder, backend="ort-cuda", **options)
    stream = gen.stream(PROMPTS, max_new_tokens=8, greedy=True, ignore_eos=True)
    for event in stream:
        addresses = inspection.kv_addresses(gen)
        bound = inspection.bound_output_addresses(gen, "prefill" if event.step == 0 else "decode")
        assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
    # A prefill at past_lens > 0 (speculation's verification) reads this call's lengths, not its first.
    lookup = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]]
    plain = gen.generate(lookup, max_new_tokens=24, greedy=True, ignore_eos=True).tokens
    assert gen.generate(lookup, max_new_tokens=24, greedy=True, ignore_eos=True, speculate="prompt-lookup").tokens == plain


def test_serving_on_ort_cuda_gives_solo_answers(exported) -> None:
    _need_ort_cuda()
    from kvforge.runtime import GenerationRequest
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.scheduler import Scheduler

    gen = Generator(exported("llama-tiny", "ort", "fp16"), backend="ort-cuda")
    prompts = [PROMPTS[i % 2] + [40 + i] * i for i in range(6)]
    lengths = [3, 20, 7, 12, 5, 16]
    solo = [gen.generate([p], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]
            for p, n in zip(prompts, lengths, strict=True)]
    scheduler = Scheduler(gen, max_batch=4, max_seq_len=128, prefill_chunk=4).start()
    try:
        handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True))
                   for p, n in zip(prompts, lengths, strict=True)]
        assert [h.result()[0] for h in handles] == solo
    finally:
        scheduler.close()


@pytest.mark.parametrize(("target", "dtype", "single"), [("trt", "fp16", False), ("trt", "fp32", True),
                                                        ("onnx", "fp16", False)])
def test_tensorrt_engines_match_hf(target, dtype, single, hf_folder, exported, tmp_path) -> None:
    _need_tensorrt()
    from kvforge.engines.trt_build import build_engines

    folder = exported("mistral-tiny", target, dtype)
    engine_dir = tmp_path / "engines"
    started = time.perf_counter()
    record = build_engines(folder, engine_dir, max_batch=4, max_seq_len=512, single_engine=single)
    print(f"build {target} {dtype} single={single}: {time.perf_counter() - started:.1f}s, "
          f"engines {record['engine_bytes']} bytes")
    assert build_engines(folder, engine_dir, max_batch=4, max_seq_len=512, single_engine=single) == record  # reused
    report = run_parity(hf_folder("mistral-tiny"), folder, new_tokens=32, backend="tensorrt",
                        backend_options={"engine_dir": engine_dir})
    print(report.summary())
    assert report.passed, report.summary()
    gen = Generator(folder, backend="tensorrt", engine_dir=engine_dir)
    result = gen.generate(PROMPTS, max_new_tokens=16, greedy=True, ignore_eos=True)
    print(f"trt: ttft {result.ttft_ms:.2f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s")
    addresses = inspection.kv_addresses(gen)
    bound = inspection.bound_output_addresses(gen, "decode")
    assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
