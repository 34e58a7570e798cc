"""The Triton attention kernel compiled on a CUDA GPU against the torch reference (same grid as the
interpreter tests, plus shapes long enough for the automatic key split). Skips without a GPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from attention_cases import CASES, Case, check_case, make_inputs  # noqa: E402

from kvforge.core.contract import PLUGIN, AttentionAttrs  # noqa: E402
from kvforge.plugins import attention_launch as launch  # noqa: E402
from kvforge.plugins import triton_attention as ta  # noqa: E402
from kvforge.plugins.reference import kv_cache_attention  # noqa: E402

GPU_CASES = [
    # Long caches: the launcher splits the keys on its own (several programs per row block).
    Case("gpu-decode-4k-auto-fp16", 2, 1, 32, 8, 128, 4096, (1000, 4095), "fp16"),
    Case("gpu-decode-16k-auto-bf16-b3", 3, 1, 32, 8, 128, 16384, (0, 9000, 16383), "bf16"),
    Case("gpu-decode-8k-auto-d64-mqa", 1, 1, 16, 1, 64, 8192, (8191,), "fp16"),
    Case("gpu-spec-verify-4-tokens", 2, 4, 32, 8, 128, 4096, (3000, 4092), "bf16"),
    # Prefill with many row blocks and key tiles, with a past, window and softcap.
    Case("gpu-prefill-512-past-fp16", 2, 512, 32, 8, 128, 1024, (0, 400), "fp16"),
    Case("gpu-prefill-300-d256-window-softcap-bf16", 1, 300, 8, 4, 256, 512, (50,), "bf16", 30.0, 128),
    Case("gpu-prefill-fp32", 1, 200, 8, 2, 64, 256, (30,), "fp32"),
]


@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=lambda c: c.name)
def test_compiled_matches_reference(case: Case) -> None:
    check_case(case, "cuda", interpret=False)


def test_launcher_shrinks_a_config_the_gpu_cannot_hold() -> None:
    # 256 x 128 tiles at head_dim 256 with 4 stages need far more shared memory than any GPU has:
    # the launch is refused (OutOfResources) and the launcher must retry smaller, still correct.
    case = Case("oversized", 1, 300, 8, 4, 256, 512, (50,), "bf16")
    config = launch.KernelConfig(block_m=256, block_n=128, num_splits=1, num_warps=8, num_stages=4)
    inputs = make_inputs(case, "cuda")
    attrs = AttentionAttrs(8, 4, 1 / 16)
    ref_out, ref_key, _ = kv_cache_attention(*inputs.values(), attrs)
    key, value = inputs["past_key"].clone(), inputs["past_value"].clone()
    out = ta.kv_cache_attention_triton(
        inputs["q"], inputs["k"], inputs["v"], key, value, inputs["past_lens"], attrs, config=config
    )
    assert torch.equal(key, ref_key)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)


def test_long_decode_really_splits() -> None:
    config = launch.choose_config(
        2, 1, 8, 4, 128, 4096, None, torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert config.num_splits > 1


def test_aot_ptx_runs_through_the_driver_api(tmp_path, monkeypatch) -> None:
    # What a TensorRT AOT plugin does: load compile_kernel's PTX with the driver, launch it with the
    # documented parameter order (inputs, int32 scalars, outputs aliased to the caches, workspace, the
    # two null scratch pointers), twice over one workspace.
    import ctypes
    import math

    import numpy as np

    driver = pytest.importorskip("cuda.bindings.driver")
    from attention_cases import TOLERANCES

    from kvforge.plugins import compile_kernel

    monkeypatch.setenv("KVFORGE_PTX_CACHE", str(tmp_path))
    major, minor = torch.cuda.get_device_capability()
    kernel = compile_kernel(arch=f"sm_{major}{minor}", dtype="float16", head_dim=64, num_heads=16, kv_num_heads=2,
                            num_splits=4)

    def ok(result):
        err = result[0] if isinstance(result, tuple) else result
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    torch.cuda.synchronize()  # the primary context is current from here on
    image = np.frombuffer(kernel.ptx.encode() + b"\0", dtype=np.uint8)
    module = ok(driver.cuModuleLoadData(image.ctypes.data))
    func = ok(driver.cuModuleGetFunction(module, kernel.name.encode()))
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    ok(driver.cuFuncSetAttribute(func, attr, kernel.shared_mem))

    case = Case("aot", 2, 1, 16, 2, 64, 256, (100, 254), "fp16")
    x = make_inputs(case, "cuda")
    key, value = x["past_key"].clone(), x["past_value"].clone()
    partials_n, counters_n = kernel.workspace_shape(case.batch, case.seq)
    partials = torch.full((partials_n,), float("nan"), device="cuda")
    counters = torch.zeros(counters_n, dtype=torch.int32, device="cuda")
    for _step in range(2):
        ref_out, ref_key, ref_value = kv_cache_attention(
            x["q"], x["k"], x["v"], key.clone(), value.clone(), x["past_lens"], AttentionAttrs(16, 2, 1 / math.sqrt(64))
        )
        out = torch.empty_like(x["q"])
        pointers = [x[n].data_ptr() for n in ("q", "k", "v")] + [key.data_ptr(), value.data_ptr()]
        pointers.append(x["past_lens"].data_ptr())
        outputs = [out.data_ptr(), key.data_ptr(), value.data_ptr(), partials.data_ptr(), counters.data_ptr()]
        values = (*pointers, case.batch, case.seq, case.capacity, *outputs, 0, 0)
        types = (ctypes.c_void_p,) * 6 + (ctypes.c_int32,) * 3 + (ctypes.c_void_p,) * 7
        assert len(values) == kernel.ptx_param_count
        grid = kernel.grid(case.batch, case.seq)
        stream = torch.cuda.current_stream().cuda_stream
        ok(
            driver.cuLaunchKernel(
                func, *grid, 32 * kernel.num_warps, 1, 1, kernel.shared_mem, stream, (values, types), 0
            )
        )
        torch.cuda.synchronize()
        assert torch.equal(key, ref_key) and torch.equal(value, ref_value)
        torch.testing.assert_close(
            out, ref_out, atol=TOLERANCES[torch.float16][0], rtol=TOLERANCES[torch.float16][1]
        )
        assert int(counters.abs().sum()) == 0
        x["past_lens"] += 1
    ok(driver.cuModuleUnload(module))


@pytest.mark.parametrize(
    ("batch", "seq", "past", "dtype", "window", "softcap"),
    [(2, 1, (100, 4000), "fp16", 0, 0.0), (3, 1, (0, 17, 2047), "bf16", 256, 0.0), (2, 37, (0, 300), "fp16", 0, 30.0)],
    ids=["decode-fp16", "decode-bf16-window", "prefill-fp16-softcap"],
)
def test_tensorrt_aot_launch_computes_the_attention(batch, seq, past, dtype, window, softcap, monkeypatch, tmp_path):
    # Exactly what a TensorRT engine would launch: the plugin's ahead-of-time function (run against the
    # stand-in of tensorrt.plugin) returns kernel name, PTX, grid and scalar args; launch them through
    # the CUDA driver with TensorRT's parameter order (inputs, scalars, outputs, nothing else), the
    # present caches being the past buffers (aliased).
    import ctypes
    import math
    import sys

    import fake_tensorrt as fake
    import numpy as np

    driver = pytest.importorskip("cuda.bindings.driver")
    from attention_cases import TOLERANCES

    monkeypatch.setenv("KVFORGE_PTX_CACHE", str(tmp_path))
    saved = {name: sys.modules.get(name) for name in ("tensorrt", "tensorrt.plugin")}
    fake.install()
    try:
        from kvforge.plugins import trt_plugin

        trt_plugin.register()  # into this stand-in; the real tensorrt keeps its own registry
        heads, kv_heads, head_dim, capacity = 32, 8, 128, 4096
        trt_dtype = {"fp16": fake.DataType.HALF, "bf16": fake.DataType.BF16}[dtype]
        e = fake.Expr
        b, s, c = e(batch, False), e(seq, seq == 1), e(capacity, False)
        inputs = [fake.TensorDesc([b, s, e(heads * head_dim)], trt_dtype)]
        inputs += [fake.TensorDesc([b, s, e(kv_heads * head_dim)], trt_dtype)] * 2
        inputs += [fake.TensorDesc([b, e(kv_heads), c, e(head_dim)], trt_dtype)] * 2
        inputs += [fake.TensorDesc([b], fake.DataType.INT32)]
        attrs = AttentionAttrs(heads, kv_heads, 1 / math.sqrt(head_dim), softcap, window)
        _, (name, ptx, params, extra) = fake.run_aot(PLUGIN.id, inputs, attrs.as_dict())
    finally:
        for key, mod in saved.items():
            sys.modules.pop(key, None) if mod is None else sys.modules.__setitem__(key, mod)

    def ok(result):
        err = result[0] if isinstance(result, tuple) else result
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    torch.cuda.synchronize()
    image = np.frombuffer(ptx.encode() + b"\0", dtype=np.uint8)
    module = ok(driver.cuModuleLoadData(image.ctypes.data))
    func = ok(driver.cuModuleGetFunction(module, name.encode()))
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    ok(driver.cuFuncSetAttribute(func, attr, params.shared_mem))

    case = Case("trt", batch, seq, heads, kv_heads, head_dim, capacity, past, dtype, softcap, window)
    x = make_inputs(case, "cuda")
    key, value = x["past_key"].clone(), x["past_value"].clone()
    ref_out, ref_key, ref_value = kv_cache_attention(
        x["q"], x["k"], x["v"], key.clone(), value.clone(), x["past_lens"], attrs
    )
    out = torch.full_like(x["q"], float("nan"))
    values = (*(x[n].data_ptr() for n in ("q", "k", "v")), key.data_ptr(), value.data_ptr(),
              x["past_lens"].data_ptr(), *(a.value for a in extra), out.data_ptr(), key.data_ptr(), value.data_ptr())
    types = (ctypes.c_void_p,) * 6 + (ctypes.c_int32,) * 3 + (ctypes.c_void_p,) * 3
    grid = (params.grid_x.value, params.grid_y.value, params.grid_z)
    stream = torch.cuda.current_stream().cuda_stream
    ok(driver.cuLaunchKernel(func, *grid, params.block_x, 1, 1, params.shared_mem, stream, (values, types), 0))
    torch.cuda.synchronize()
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol[0], rtol=tol[1])
    ok(driver.cuModuleUnload(module))
