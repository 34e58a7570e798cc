"""kvforge's TensorRT plugin: the fused attention node as a TensorRT quickly deployable plugin (QDP).

`register()` (imports TensorRT lazily; call it before parsing a `trt`-target graph) registers
`kvforge::KVCacheAttention` with `tensorrt.plugin`, unless that module already has it (asked of TensorRT's
registry, so a test's stand-in registered first does not hide the plugin from the real TensorRT):

- the shape/type description: `out` like `q`; `present_key` / `present_value` **aliased** to
  `past_key` / `past_value`, so TensorRT hands the kernel the cache buffers themselves and the new
  rows are written in place (TensorRT's aliased-plugin-IO preview feature must be enabled on the
  builder config; kvforge's build does that);
- an **ahead-of-time** implementation only (no Python at run time): it returns the Triton kernel's
  PTX for the build GPU's architecture (plugins/ptx.py, `tensorrt=True`: no workspace, and exactly the
  parameters TensorRT passes), the launch grid as shape expressions, and the int32 scalars
  (batch, seq_len, capacity) as symbolic extra arguments. The plugin's attributes (heads, scale,
  softcap, window) are compiled into the PTX as constants, since TensorRT does not serialize them into
  the engine, so a built engine runs from C++ or `trtexec` without kvforge.

Not proven here (no TensorRT on the machines this was written on): that TensorRT accepts the
aliased outputs of an ahead-of-time plugin and launches the PTX with more than 48 KiB of dynamic
shared memory (the default kernels want 70-130 KiB; `KernelLaunchParams` has no documented opt-in).
`register(max_shared_kib=48)` (`kvforge build --plugin-shared-mem 48`) compiles variants with smaller
tiles that stay within 48 KiB, which any launch may use.
What is proven on the CPU and on a GPU without TensorRT: the registration functions against a stand-in
of `tensorrt.plugin`'s documented API (tests/test_trt_plugin.py), and that the very PTX, grid and
arguments the ahead-of-time function returns compute the attention when launched through the CUDA
driver in TensorRT's parameter order (tests/test_attention_kernel_gpu.py).

This module must not use `from __future__ import annotations`: `tensorrt.plugin` reads the decorated
functions' annotations as live types.
"""

import os
from dataclasses import dataclass
from typing import Any

from kvforge.plugins import attention_launch as launch

PLUGIN_NAMESPACE = "kvforge"
PLUGIN_NAME = "KVCacheAttention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
PLUGIN_VERSION = "1"
ARCH_ENV = "KVFORGE_TRT_ARCH"  # e.g. sm_90: the architecture to compile for when no GPU can be asked
# TensorRT's DataType names -> the kernel's dtype names.
TRT_DTYPE_NAMES = {"HALF": "float16", "BF16": "bfloat16", "FLOAT": "float32"}
# The build's choices that the ahead-of-time function reads when TensorRT calls it: set by every register()
# call, since the function is registered once per tensorrt module and outlives one build.
_build_options: dict[str, Any] = {"max_shared_kib": None}


@dataclass(frozen=True)
class AotPlan:
    """Everything the ahead-of-time implementation decides from build-time facts (plain values)."""

    arch: str
    dtype: str
    head_dim: int
    num_heads: int
    kv_num_heads: int
    scale: float
    softcap: float
    sliding_window: int
    regime: str  # "decode" when the query length is the constant 1, else "prefill"
    max_shared_kib: int | None = None  # a cap below the arch's shared memory limit (e.g. 48)

    def compile_kwargs(self) -> dict[str, Any]:
        return dict(arch=self.arch, dtype=self.dtype, head_dim=self.head_dim, num_heads=self.num_heads,
                    kv_num_heads=self.kv_num_heads, scale=self.scale, softcap=self.softcap,
                    sliding_window=self.sliding_window, regime=self.regime, num_splits=1, tensorrt=True,
                    max_shared_kib=self.max_shared_kib)


def aot_plan(
    dtype: str, head_dim: int, seq_len: int | None, num_heads: int, kv_num_heads: int, scale: float,
    softcap: float, sliding_window: int, arch: str, max_shared_kib: int | None = None,
) -> AotPlan:
    """The variant to compile: `seq_len` is the query length if it is a build-time constant, else None;
    `max_shared_kib` caps its dynamic shared memory (smaller tiles)."""
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"kvforge's attention plugin supports float16, bfloat16 and float32, not {dtype}")
    launch.check_shapes(num_heads, kv_num_heads, head_dim)
    regime = "decode" if seq_len is not None and seq_len * (num_heads // kv_num_heads) <= 64 else "prefill"
    return AotPlan(arch, dtype, int(head_dim), int(num_heads), int(kv_num_heads), float(scale),
                   float(softcap), int(sliding_window), regime, max_shared_kib)


def device_arch() -> str:
    """The compute capability to compile for: KVFORGE_TRT_ARCH, else the current CUDA device's."""
    if os.environ.get(ARCH_ENV):
        return os.environ[ARCH_ENV]
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except ImportError:
        pass
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        _, device = driver.cuDeviceGet(0)
        attr = driver.CUdevice_attribute
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        return f"sm_{major}{minor}"
    except Exception as err:  # no cuda-python, or no device
        raise RuntimeError(
            f"cannot tell which GPU architecture to compile the attention plugin for; set {ARCH_ENV}=sm_90 "
            "(or install torch with CUDA or cuda-python)"
        ) from err


def _dtype_name(trt_dtype: Any) -> str:
    name = getattr(trt_dtype, "name", str(trt_dtype)).split(".")[-1].upper()
    if name not in TRT_DTYPE_NAMES:
        raise ValueError(f"kvforge's attention plugin supports float16, bfloat16 and float32, not {name}")
    return TRT_DTYPE_NAMES[name]


def _constant(expr: Any) -> int | None:
    return int(expr.constant_value()) if expr.is_constant else None


def is_registered(trtp: Any) -> bool:
    """Whether this `tensorrt.plugin` module already defines kvforge::KVCacheAttention. TensorRT's own
    record is asked (`tensorrt.plugin.op.<namespace>.<name>`, what its `register` checks before it refuses
    a duplicate), not a flag of ours: another `tensorrt` (a test's stand-in, then the real one) starts
    empty and must be registered with again."""
    namespace = getattr(trtp.op, PLUGIN_NAMESPACE, None)
    return namespace is not None and hasattr(namespace, PLUGIN_NAME)


def register(max_shared_kib: int | None = None) -> None:
    """Register the plugin with the `tensorrt.plugin` imported now, unless it already has it.
    `max_shared_kib`: compile the kernels for the engines built from now on with at most this much dynamic
    shared memory (48: launchable without the opt-in above 48 KiB); None: up to the GPU's limit."""
    _build_options["max_shared_kib"] = max_shared_kib
    import tensorrt.plugin as trtp

    if is_registered(trtp):
        return

    from kvforge.plugins.ptx import compile_kernel

    @trtp.register(PLUGIN_ID)
    def describe(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, past_key: trtp.TensorDesc,
        past_value: trtp.TensorDesc, past_lens: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
        scale: float, softcap: float, sliding_window: int,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        # present_* share the past_* buffers: the kernel appends the new rows in place.
        return q.like(), past_key.aliased(), past_value.aliased()

    @trtp.aot_impl(PLUGIN_ID)
    def aot(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, past_key: trtp.TensorDesc,
        past_value: trtp.TensorDesc, past_lens: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
        scale: float, softcap: float, sliding_window: int, outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        head_dim = _constant(past_key.shape_expr[3])
        if head_dim is None:
            raise ValueError("the cache's head dimension must be static")
        plan = aot_plan(_dtype_name(q.dtype), head_dim, _constant(q.shape_expr[1]), num_heads, kv_num_heads,
                        scale, softcap, sliding_window, device_arch(), _build_options["max_shared_kib"])
        kernel = compile_kernel(**plan.compile_kwargs())
        batch, seq, capacity = q.shape_expr[0], q.shape_expr[1], past_key.shape_expr[2]
        group = num_heads // kv_num_heads
        # The grid of attention_launch.launch_grid, as shape expressions: (row blocks, B * Hkv, 1).
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(seq * group, kernel.block_m)
        params.grid_y = batch * kv_num_heads
        params.grid_z = 1
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared_mem
        # Kernel parameters: inputs, these scalars (attention_launch.SCALAR_PARAMS order), outputs.
        extra = trtp.SymIntExprs(len(launch.SCALAR_PARAMS))
        extra[0], extra[1], extra[2] = trtp.SymInt32(batch), trtp.SymInt32(seq), trtp.SymInt32(capacity)
        return kernel.name, kernel.ptx, params, extra
