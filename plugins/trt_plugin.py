"""kvforge's TensorRT plugin: the fused attention node as a TensorRT quickly deployable plugin (QDP).

`register()` (imports TensorRT lazily; call it before parsing a `trt`-target graph) registers the plugin
`contract.PLUGIN.id` with `tensorrt.plugin`, unless that module already has it (asked of TensorRT's
registry, so a test's stand-in registered first does not hide the plugin from the real TensorRT):

- the shape/type description: `out` like `q`; `present_key` / `present_value` **aliased** to
  `past_key` / `past_value`, so TensorRT hands the kernel the cache buffers themselves and the new
  rows are written in place (TensorRT's aliased-plugin-IO preview feature must be enabled on the
  builder config; kvforge's build does that);
- an **ahead-of-time** implementation only (no Python at run time): it returns the Triton kernel's
  PTX for the build GPU's architecture, or register()'s `arch` (plugins/ptx.py, `tensorrt=True`: no
  workspace, and exactly the parameters TensorRT passes), the launch grid as shape expressions, and the int32 scalars
  (batch, seq_len, capacity) as symbolic extra arguments. The plugin's attributes (heads, scale,
  softcap, window) are compiled into the PTX as constants, since TensorRT does not serialize them into
  the engine, so a built engine runs from C++ or `trtexec` without kvforge.

Not proven here (no TensorRT on the machines this was written on): that TensorRT accepts the
aliased outputs of an ahead-of-time plugin and launches the PTX with more than 48 KiB of dynamic
shared memory (the default kernels want 70-130 KiB; `KernelLaunchParams` has no documented opt-in).
`register(max_shared_kib=48)` (`kvforge build --plugin-shared-mem 48`) compiles variants with smaller
tiles that stay within 48 KiB, which any launch may use.
What is proven on the CPU and on a GPU without TensorRT: the registration functions against a stand-in
of `tensorrt.plugin`'s documented API (tests/engines/test_trt_plugin.py), and that the very PTX, grid and
arguments the ahead-of-time function returns compute the attention when launched through the CUDA
driver in TensorRT's parameter order (tests/engines/test_attention_kernel_gpu.py).

This module must not use `from __future__ import annotations`: `tensorrt.plugin` reads the decorated
functions' annotations as live types.
"""

import re
from dataclasses import dataclass
from typing import Any

from kvforge.core.contract import (
    PLUGIN,
    AttentionAttrs,
    attention_parameters,
    check_attention_parameters,
)
from kvforge.plugins import attention_launch as launch
from kvforge.plugins.ptx import KernelVariant, compile_kernel

# TensorRT's DataType names -> the kernel's dtype names.
TRT_DTYPE_NAMES = {"HALF": "float16", "BF16": "bfloat16", "FLOAT": "float32"}
# The build's choices that the ahead-of-time function reads when TensorRT calls it: set by every register()
# call, since the function is registered once per tensorrt module and outlives one build.
_build_options: dict[str, Any] = {"max_shared_kib": None, "arch": None}


@dataclass(frozen=True)
class AotPlan:
    """Everything the ahead-of-time implementation decides from build-time facts (plain values)."""

    arch: str
    dtype: str
    head_dim: int
    attrs: AttentionAttrs
    regime: str  # "decode" when the query length is the constant 1, else "prefill"
    max_shared_kib: int | None = None  # a cap below the arch's shared memory limit (e.g. 48)

    def variant(self) -> KernelVariant:
        """The kernel variant to compile: TensorRT's (no workspace, so no key split)."""
        return KernelVariant(arch=self.arch, dtype=self.dtype, head_dim=self.head_dim, attrs=self.attrs,
                             regime=self.regime, num_splits=1, tensorrt=True, max_shared_kib=self.max_shared_kib)


def aot_plan(
    dtype: str, head_dim: int, seq_len: int | None, attrs: AttentionAttrs, arch: str,
    max_shared_kib: int | None = None,
) -> AotPlan:
    """The variant to compile: `seq_len` is the query length if it is a build-time constant, else None;
    `max_shared_kib` caps its dynamic shared memory (smaller tiles)."""
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"kvforge's attention plugin supports float16, bfloat16 and float32, not {dtype}")
    launch.check_shapes(attrs.num_heads, attrs.kv_num_heads, head_dim)
    group = attrs.num_heads // attrs.kv_num_heads
    regime = "decode" if seq_len is not None and seq_len * group <= 64 else "prefill"
    return AotPlan(arch, dtype, int(head_dim), attrs, regime, max_shared_kib)


def check_arch(arch: str) -> str:
    """`arch` if it names a compute capability the way the compiler takes it (sm_90), else ValueError."""
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+a?", arch.strip().lower()):
        raise ValueError(f"the plugin's GPU architecture must look like sm_90, got {arch!r}")
    return arch.strip().lower()


def device_arch(arch: str | None = None) -> str:
    """The compute capability to compile for: `arch` (register()'s, for a machine whose GPU cannot be
    asked), else the current CUDA device's."""
    if arch:
        return arch
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
            "cannot tell which GPU architecture to compile the attention plugin for; pass it "
            "(kvforge build --arch sm_90, or register(arch='sm_90')), or install torch with CUDA or cuda-python"
        ) from err


def _dtype_name(trt_dtype: Any) -> str:
    name = getattr(trt_dtype, "name", str(trt_dtype)).split(".")[-1].upper()
    if name not in TRT_DTYPE_NAMES:
        raise ValueError(f"kvforge's attention plugin supports float16, bfloat16 and float32, not {name}")
    return TRT_DTYPE_NAMES[name]


def _constant(expr: Any) -> int | None:
    return int(expr.constant_value()) if expr.is_constant else None


def is_registered(trtp: Any) -> bool:
    """Whether this `tensorrt.plugin` module already defines kvforge's plugin (contract.PLUGIN). TensorRT's
    own record is asked (`tensorrt.plugin.op.<namespace>.<name>`, what its `register` checks before it
    refuses a duplicate), not a flag of ours: another `tensorrt` (a test's stand-in, then the real one)
    starts empty and must be registered with again."""
    namespace = getattr(trtp.op, PLUGIN.namespace, None)
    return namespace is not None and hasattr(namespace, PLUGIN.name)


def register(max_shared_kib: int | None = None, arch: str | None = None) -> None:
    """Register the plugin with the `tensorrt.plugin` imported now, unless it already has it. The options
    apply to the engines built from now on: `max_shared_kib` compiles the kernels with at most this much
    dynamic shared memory (48: launchable without the opt-in above 48 KiB; None: up to the GPU's limit);
    `arch` (e.g. sm_90) is the architecture to compile for (None: the current GPU's)."""
    _build_options["max_shared_kib"] = max_shared_kib
    _build_options["arch"] = check_arch(arch) if arch is not None else None
    import tensorrt.plugin as trtp

    if is_registered(trtp):
        return

    def describe(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, past_key: trtp.TensorDesc,
        past_value: trtp.TensorDesc, past_lens: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
        scale: float, softcap: float, sliding_window: int,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        # present_* share the past_* buffers: the kernel appends the new rows in place.
        return q.like(), past_key.aliased(), past_value.aliased()

    def aot(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, past_key: trtp.TensorDesc,
        past_value: trtp.TensorDesc, past_lens: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
        scale: float, softcap: float, sliding_window: int, outputs: tuple[trtp.TensorDesc], tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        attrs = AttentionAttrs(num_heads, kv_num_heads, scale, softcap, sliding_window)
        head_dim = _constant(past_key.shape_expr[3])
        if head_dim is None:
            raise ValueError("the cache's head dimension must be static")
        plan = aot_plan(_dtype_name(q.dtype), head_dim, _constant(q.shape_expr[1]), attrs,
                        device_arch(_build_options["arch"]), _build_options["max_shared_kib"])
        kernel = compile_kernel(plan.variant())
        batch, seq, capacity = q.shape_expr[0], q.shape_expr[1], past_key.shape_expr[2]
        group = attrs.num_heads // attrs.kv_num_heads
        # The grid of attention_launch.launch_grid, as shape expressions: (row blocks, B * Hkv, 1).
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(seq * group, kernel.block_m)
        params.grid_y = batch * attrs.kv_num_heads
        params.grid_z = 1
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared_mem
        # Kernel parameters: inputs, these scalars (attention_launch.SCALAR_PARAMS order), outputs.
        extra = trtp.SymIntExprs(len(launch.SCALAR_PARAMS))
        extra[0], extra[1], extra[2] = trtp.SymInt32(batch), trtp.SymInt32(seq), trtp.SymInt32(capacity)
        return kernel.name, kernel.ptx, params, extra

    # tensorrt.plugin needs the parameters spelled out; they must still be the contract's, in its order.
    check_attention_parameters(describe, attention_parameters())
    check_attention_parameters(aot, attention_parameters() + ("outputs", "tactic"))
    trtp.register(PLUGIN.id)(describe)
    trtp.aot_impl(PLUGIN.id)(aot)
