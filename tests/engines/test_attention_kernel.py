"""The Triton attention kernel on the CPU: Triton's interpreter against the torch reference, the launch
arithmetic, and ahead-of-time PTX for sm_80 .. sm_90 (no GPU needed for any of it)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from attention_cases import CASES, TOLERANCES, Case, check_case, make_inputs  # noqa: E402

from kvforge.core.contract import AttentionAttrs  # noqa: E402
from kvforge.plugins import attention_launch as launch  # noqa: E402
from kvforge.plugins import triton_attention as ta  # noqa: E402
from kvforge.plugins.reference import kv_cache_attention  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreter_matches_reference(case: Case) -> None:
    check_case(case, "cpu", interpret=True)


def test_decode_loop_reuses_workspace() -> None:
    # Prefill, then decode steps with splits over the same caches and workspace: each step must see
    # the rows the previous steps appended and a workspace the previous launch left clean.
    case = Case("loop", 2, 5, 8, 2, 32, 24, (0, 6))
    inputs = make_inputs(case, "cpu", seed=1)
    attrs = AttentionAttrs(8, 2, 1.0 / math.sqrt(32))
    ref_key, ref_value = inputs["past_key"].clone(), inputs["past_value"].clone()
    key, value = inputs["past_key"].clone(), inputs["past_value"].clone()
    lens = inputs["past_lens"].clone()
    gen = torch.Generator().manual_seed(2)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    for step in range(4):
        splits = 1 if step == 0 else 3
        ref_out, ref_key, ref_value = kv_cache_attention(q, k, v, ref_key, ref_value, lens, attrs)
        out = ta.run_interpreted(q, k, v, key, value, lens, attrs, num_splits=splits, block_n=16)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
        assert torch.equal(key, ref_key) and torch.equal(value, ref_value)
        lens = lens + q.shape[1]
        q, k, v = (torch.randn(2, 1, x.shape[2], generator=gen) for x in (q, k, v))


def test_interpreter_without_env_and_with_env_agree() -> None:
    # The launcher must pick the interpreter for CPU tensors whatever TRITON_INTERPRET says; run one
    # case in a child process with the variable set (triton then imports in interpreter mode).
    code = "import attention_cases as c; print(c.check_case(c.CASES[3], 'cpu', interpret=None))"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) <= TOLERANCES[torch.float32][0]


def test_rejects_bad_calls() -> None:
    case = Case("bad", 1, 4, 4, 2, 32, 8, (5,))
    inputs = make_inputs(case, "cpu")
    with pytest.raises(ValueError, match="capacity"):
        ta.run_interpreted(*inputs.values(), AttentionAttrs(4, 2, 0.1))
    with pytest.raises(ValueError, match="multiple"):
        launch.check_shapes(6, 4, 64)
    with pytest.raises(ValueError, match="power of two"):
        launch.check_shapes(4, 2, 48)


def test_kernel_parameter_order() -> None:
    # TensorRT's AOT path: input pointers, then int32 scalars, then outputs (caches aliased), then the
    # workspace; the constexprs follow (they are compiled in, not passed).
    names = list(inspect.signature(ta._kv_cache_attention_kernel).parameters)
    assert names == list(launch.KERNEL_PARAMS)
    assert list(launch.signature("float16")) == list(launch.RUNTIME_PARAMS)
    assert launch.RUNTIME_PARAMS[:9] == (
        "q", "k", "v", "past_key", "past_value", "past_lens", "batch", "seq_len", "capacity",
    )  # fmt: skip
    assert launch.RUNTIME_PARAMS[9:12] == ("out", "present_key", "present_value")


def test_launch_arithmetic() -> None:
    assert launch.launch_grid(batch=3, seq=5, kv_heads=2, group=4, num_splits=2, block_m=16) == (2, 6, 2)
    assert launch.workspace_shape(3, 5, 2, 4, 64, num_splits=1, block_m=16) == (0, 0)
    assert launch.workspace_shape(3, 5, 2, 4, 64, num_splits=4, block_m=16) == (12 * 4 * 16 * 66, 12)
    assert launch.workspace_bytes(3, 5, 2, 4, 64, 4, 16) == 4 * (12 * 4 * 16 * 66 + 12)
    # Prefill and short caches: no split. Long-cache decode on few programs: enough to fill the SMs.
    assert launch.choose_config(1, 2048, 8, 4, 128, 4096).num_splits == 1
    assert launch.choose_config(1, 1, 8, 4, 128, 256).num_splits == 1
    long = launch.choose_config(1, 1, 8, 4, 128, 32768)
    assert long.block_m == 16 and 8 < long.num_splits <= launch.MAX_SPLITS
    assert long.num_splits & (long.num_splits - 1) == 0
    assert launch.choose_config(64, 1, 8, 4, 128, 32768).num_splits == 1  # 512 programs already
    assert launch.choose_config(1, 1, 8, 4, 128, 32768, num_splits=5).num_splits == 5


def test_shrink_config_steps_down_to_a_floor() -> None:
    config = launch.KernelConfig(block_m=128, block_n=64, num_splits=1, num_warps=8, num_stages=3)
    steps = []
    while config is not None:
        steps.append((config.block_m, config.block_n, config.num_warps, config.num_stages))
        config = launch.shrink_config(config)
    assert steps == [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 32, 4, 1)]
    assert launch.max_shared_bytes(86) < launch.max_shared_bytes(80) < launch.max_shared_bytes(90)


def test_import_plugins_stays_light() -> None:
    code = (
        "import sys, kvforge.plugins as p; f = p.compile_ptx; "
        "print(sorted(m for m in ('triton', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time PTX. One session-wide cache directory: each variant compiles once per test run.


PTX_ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90"]
PTX_DTYPES = ["float16", "bfloat16"]
PTX_HEAD_DIMS = [64, 128, 256]


@pytest.fixture(scope="module")
def ptx_cache(tmp_path_factory: pytest.TempPathFactory):
    from kvforge.plugins import compile_kernels

    path = tmp_path_factory.mktemp("ptx-cache")
    old = os.environ.get("KVFORGE_PTX_CACHE")
    os.environ["KVFORGE_PTX_CACHE"] = str(path)
    # All variants in one batch: under TRITON_INTERPRET that is one child process, not 24.
    variants = [
        {"arch": a, "dtype": t, "head_dim": d, "num_heads": 32, "kv_num_heads": 8}
        for a in PTX_ARCHS
        for t in PTX_DTYPES
        for d in PTX_HEAD_DIMS
    ]
    # head_dim 256 prefill tiles need more shared memory than sm_86 offers (see the fit test).
    variants += [
        {
            "arch": a,
            "dtype": "bfloat16",
            "head_dim": 256,
            "num_heads": 8,
            "kv_num_heads": 2,
            "regime": "prefill",
        }
        for a in ("sm_86", "sm_90")
    ]
    compile_kernels(variants)
    yield path
    if old is None:
        del os.environ["KVFORGE_PTX_CACHE"]
    else:
        os.environ["KVFORGE_PTX_CACHE"] = old


@pytest.mark.parametrize("head_dim", PTX_HEAD_DIMS)
@pytest.mark.parametrize("dtype", PTX_DTYPES)
@pytest.mark.parametrize("arch", PTX_ARCHS)
def test_compile_ptx_targets_arch(arch: str, dtype: str, head_dim: int, ptx_cache) -> None:
    from kvforge.plugins import compile_kernel, compile_ptx
    from kvforge.plugins.ptx import KernelVariant, ptx_target

    ptx = compile_ptx(arch=arch, dtype=dtype, head_dim=head_dim, num_heads=32, kv_num_heads=8)
    ((name, text),) = ptx.items()
    assert ptx_target(text).startswith(arch)  # sm_90 comes out as sm_90a
    assert f".entry {name}(" in text
    variant = KernelVariant(arch, dtype, head_dim, AttentionAttrs(32, 8, 1.0 / math.sqrt(head_dim)))
    kernel = compile_kernel(variant)  # the same variant as the keywords above: cached, the same PTX
    assert kernel.ptx == text and kernel.block_m == 16 and kernel.num_warps >= 4
    assert 0 < kernel.shared_mem <= 227 * 1024
    # The runtime parameters, then the two scratch pointers triton appends to every kernel.
    assert kernel.ptx_param_count == len(launch.RUNTIME_PARAMS) + 2


def test_compile_fits_the_arch_shared_memory(ptx_cache) -> None:
    from kvforge.plugins import compile_kernel

    kw = {"dtype": "bfloat16", "head_dim": 256, "num_heads": 8, "kv_num_heads": 2, "regime": "prefill"}
    big = compile_kernel(arch="sm_90", **kw)
    small = compile_kernel(arch="sm_86", **kw)
    assert big.shared_mem > launch.max_shared_bytes(86)  # so sm_86 really had to shrink
    assert small.shared_mem <= launch.max_shared_bytes(86)
    assert small.block_m < big.block_m and small.constants["BLOCK_M"] == small.block_m


def test_compile_ptx_under_triton_interpret(ptx_cache) -> None:
    # CI may set TRITON_INTERPRET=1; compiling must still work (it moves to a child process).
    code = (
        "import json, triton; from kvforge.plugins import compile_kernel; "
        "k = compile_kernel(arch='sm_80', dtype='float16', head_dim=64, num_heads=4, kv_num_heads=2, sliding_window=8, "
        "regime='prefill', num_splits=1); "
        "print(json.dumps([k.name, k.ptx[:4000], k.block_m]))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", KVFORGE_PTX_CACHE=str(ptx_cache / "interpret"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, head, block_m = json.loads(proc.stdout)
    assert ".target sm_80" in head and block_m == 64
