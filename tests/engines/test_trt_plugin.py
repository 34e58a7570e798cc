"""kvforge's TensorRT plugin up to TensorRT's API: registration, aliasing, the ahead-of-time plan.

TensorRT cannot be installed here, so `tensorrt.plugin` is replaced by a stand-in that follows its
documented API (tests/engines/fake_tensorrt.py). What TensorRT would do with the result is not tested here;
that the returned PTX, grid and arguments compute the attention is tested on a GPU
(tests/engines/test_attention_kernel_gpu.py::test_tensorrt_aot_launch_*).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import fake_tensorrt as fake
import pytest

from kvforge.core.contract import ATTENTION_INPUTS, PLUGIN, AttentionAttrs
from kvforge.plugins import attention_launch as launch

pytest.importorskip("triton")


@pytest.fixture
def trt_plugin(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORGE_PTX_CACHE", str(tmp_path / "ptx"))
    with installed_fake():
        fake.install()
        import kvforge.plugins.trt_plugin as module

        module.register(arch=ARCH)  # no GPU to ask here
        yield module


@contextlib.contextmanager
def installed_fake():
    """Put back whatever `tensorrt` modules were there before (fake.install() replaces them)."""
    saved = {name: sys.modules.get(name) for name in ("tensorrt", "tensorrt.plugin")}
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def descs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, capacity: int, dtype=fake.DataType.HALF,
          seq_constant: bool = True):
    e = fake.Expr
    dyn_b, dyn_s, dyn_c = e(batch, False), e(seq, seq_constant), e(capacity, False)
    return [
        fake.TensorDesc([dyn_b, dyn_s, e(heads * head_dim)], dtype),
        fake.TensorDesc([dyn_b, dyn_s, e(kv_heads * head_dim)], dtype),
        fake.TensorDesc([dyn_b, dyn_s, e(kv_heads * head_dim)], dtype),
        fake.TensorDesc([dyn_b, e(kv_heads), dyn_c, e(head_dim)], dtype),
        fake.TensorDesc([dyn_b, e(kv_heads), dyn_c, e(head_dim)], dtype),
        fake.TensorDesc([dyn_b], fake.DataType.INT32),
    ]


ARCH = "sm_90"
ATTRS = AttentionAttrs(num_heads=32, kv_num_heads=8, scale=128**-0.5).as_dict()


def test_importing_the_plugin_module_needs_no_tensorrt() -> None:
    code = "import sys, kvforge.plugins.trt_plugin; assert 'tensorrt' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_stand_in_refuses_a_duplicate_registration_like_tensorrt() -> None:
    # tensorrt/plugin/_lib.py's register raises ValueError when op.<namespace>.<name> is already defined.
    with installed_fake():
        trtp = fake.install()

        def describe(q, num_heads):
            return q.like()

        # Live types, as tensorrt.plugin reads them (this file's annotations are strings).
        describe.__annotations__ = {"q": trtp.TensorDesc, "num_heads": int, "return": tuple}
        trtp.register("kvforge::Probe")(describe)
        with pytest.raises(ValueError, match="already has a definition for 'Probe'"):
            trtp.register("kvforge::Probe")(describe)
        fresh = fake.install()  # a new TensorRT starts empty
        assert not hasattr(fresh.op, "kvforge") and fake.REGISTRY == {}


def test_register_asks_each_tensorrt_not_a_process_flag() -> None:
    # A stand-in registered first (the GPU kernel test does that), then another TensorRT in the same
    # process (a real build in the same pytest run): the second must get the plugin too.
    from kvforge.plugins import trt_plugin

    with installed_fake():
        first = fake.install()
        trt_plugin.register()
        assert hasattr(getattr(first.op, PLUGIN.namespace), PLUGIN.name)
        second = fake.install()
        trt_plugin.register()
        trt_plugin.register()  # again into the same TensorRT: no duplicate (TensorRT would raise)
        assert hasattr(getattr(second.op, PLUGIN.namespace), PLUGIN.name)
        assert "aot" in fake.REGISTRY[PLUGIN.id]
        creator = sys.modules["tensorrt"].get_plugin_registry().get_creator(PLUGIN.name, PLUGIN.version, PLUGIN.namespace)
        assert creator is not None and creator.plugin_namespace == PLUGIN.namespace


def test_registration_declares_aliased_caches_and_the_documented_schema(trt_plugin) -> None:
    entry = fake.REGISTRY[PLUGIN.id]
    assert entry["tensors"] == list(ATTENTION_INPUTS)
    assert entry["attrs"] == list(AttentionAttrs.names())
    inputs = descs(2, 1, 32, 8, 128, 4096)
    (out, present_key, present_value), _ = fake.run_aot(PLUGIN.id, inputs, ATTRS)
    assert out.aliased_to is None and out.dtype == inputs[0].dtype
    assert present_key.aliased_to is inputs[3] and present_value.aliased_to is inputs[4]


def test_decode_plan_compiles_the_tensorrt_variant(trt_plugin) -> None:
    inputs = descs(3, 1, 32, 8, 128, 4096)
    _, (name, ptx, params, extra) = fake.run_aot(PLUGIN.id, inputs, ATTRS)
    assert re.search(r"^\s*\.target\s+sm_90", ptx, re.MULTILINE)
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.DOTALL)
    # Exactly what TensorRT passes: 6 inputs, 3 int32 scalars, 3 outputs (no workspace, no scratch).
    kinds = re.findall(r"\.param\s+\.(u64|u32)", entry.group(1))
    assert kinds == ["u64"] * 6 + ["u32"] * 3 + ["u64"] * 3
    assert [a.value for a in extra] == [3, 1, 4096]  # batch, seq_len, capacity
    assert not extra[0].is_constant and extra[1].is_constant and not extra[2].is_constant
    kernel = trt_plugin_kernel(trt_plugin, inputs, regime="decode")
    assert (params.grid_x.value, params.grid_y.value, params.grid_z) == launch.launch_grid(3, 1, 8, 4, 1, kernel.block_m)
    assert params.block_x == kernel.num_warps * 32 and params.shared_mem == kernel.shared_mem
    assert ptx == kernel.ptx


def test_prefill_plan_uses_prefill_tiles_and_a_symbolic_grid(trt_plugin) -> None:
    inputs = descs(2, 300, 32, 8, 128, 4096, seq_constant=False)
    _, (_, _, params, extra) = fake.run_aot(PLUGIN.id, inputs, ATTRS)
    kernel = trt_plugin_kernel(trt_plugin, inputs, regime="prefill")
    assert kernel.block_m >= 64
    assert not params.grid_x.is_constant  # grows with the sequence length at run time
    assert (params.grid_x.value, params.grid_y.value) == launch.launch_grid(2, 300, 8, 4, 1, kernel.block_m)[:2]
    assert [a.value for a in extra] == [2, 300, 4096]


def test_a_capped_build_compiles_a_variant_within_48_kib(trt_plugin) -> None:
    # TensorRT's KernelLaunchParams has no documented opt-in above 48 KiB of dynamic shared memory.
    inputs = descs(2, 1, 32, 8, 128, 4096)
    _, (_, _, default, _) = fake.run_aot(PLUGIN.id, inputs, ATTRS)
    assert default.shared_mem > 48 * 1024  # the default decode tiles need more: the cap has work to do
    trt_plugin.register(max_shared_kib=48, arch=ARCH)  # already registered: only the build's choices change
    try:
        _, (name, ptx, params, extra) = fake.run_aot(PLUGIN.id, inputs, ATTRS)
    finally:
        trt_plugin.register(arch=ARCH)
    assert 0 < params.shared_mem <= 48 * 1024
    kernel = trt_plugin_kernel(trt_plugin, inputs, regime="decode", max_shared_kib=48)
    assert (name, ptx, params.shared_mem) == (kernel.name, kernel.ptx, kernel.shared_mem)
    assert params.block_x == kernel.num_warps * 32
    assert (params.grid_x.value, params.grid_y.value) == launch.launch_grid(2, 1, 8, 4, 1, kernel.block_m)[:2]
    assert [a.value for a in extra] == [2, 1, 4096]


def test_shared_memory_cap_arguments_are_checked() -> None:
    from kvforge.plugins.ptx import compile_kernel

    with pytest.raises(ValueError, match="max_shared_kib must be a positive number of KiB, got 0"):
        compile_kernel(arch="sm_90", max_shared_kib=0)
    with pytest.raises(ValueError, match="needs fit_shared=True"):
        compile_kernel(arch="sm_90", max_shared_kib=48, fit_shared=False)


@pytest.mark.parametrize(("dtype", "head_dim", "message"), [
    (fake.DataType.INT8, 128, "supports float16, bfloat16 and float32, not INT8"),
    (fake.DataType.HALF, 96, "head_dim must be a power of two"),
])
def test_unsupported_inputs_are_refused_at_build(trt_plugin, dtype, head_dim, message) -> None:
    with pytest.raises(ValueError, match=message):
        fake.run_aot(PLUGIN.id, descs(1, 1, 32, 8, head_dim, 64, dtype=dtype), ATTRS)


def test_plan_is_a_plain_function() -> None:
    from kvforge.plugins.trt_plugin import aot_plan

    plan = aot_plan("bfloat16", 64, None, AttentionAttrs(9, 3, 0.125), "sm_80")
    assert plan.regime == "prefill" and plan.variant().tensorrt is True and plan.variant().num_splits == 1
    assert aot_plan("float16", 128, 1, AttentionAttrs(32, 8, 0.1, 0.0, 4096), "sm_90").regime == "decode"
    assert aot_plan("float16", 128, 4, AttentionAttrs(32, 8, 0.1), "sm_90").regime == "decode"  # 4 x 4 rows: spec verify
    assert aot_plan("float16", 128, 1, AttentionAttrs(32, 8, 0.1), "sm_90", 48).variant().max_shared_kib == 48


def test_the_architecture_is_a_registration_option_not_the_environment(monkeypatch) -> None:
    from kvforge.plugins import trt_plugin

    with pytest.raises(ValueError, match="must look like sm_90, got '90a'"):
        trt_plugin.register(arch="90a")
    # Without an arch and without a GPU to ask, the error names the option.
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(RuntimeError, match=r"kvforge build --arch sm_90, or register\(arch='sm_90'\)"):
        trt_plugin.device_arch(None)
    assert trt_plugin.device_arch("sm_86") == "sm_86"


def trt_plugin_kernel(module, inputs, regime: str, **kw):
    from kvforge.plugins.ptx import compile_kernel

    return compile_kernel(arch=ARCH, dtype="float16", head_dim=128, attrs=AttentionAttrs.from_mapping(ATTRS),
                          regime=regime, num_splits=1, tensorrt=True, **kw)
