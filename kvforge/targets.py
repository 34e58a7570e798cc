"""The export targets: how each lowers the fused attention node, what it runs in, and what can be
built from it. One entry per target; the exporter, the engine build, the backends and the CLI read
these fields and never compare a target's name themselves.

Adding a target: an entry here plus its lowering pass (a function named by `lowering`, in
exporter/lowering.py or a module of its own); the backends that run it list it in
runtime/backend.py's REGISTRY.
Plain Python, so the runtime and the CLI can read it without the exporter's stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.contract import DTYPES, PLUGIN, PluginIdentity
from kvforge.errors import InputError


@dataclass(frozen=True)
class Target:
    name: str
    summary: str  # the attention op the target lowers to
    lowering: str  # "module:function": the pass that rewrites the canonical node (imported at export)
    dtypes: tuple[str, ...]  # export dtypes the target accepts
    support: str  # what it runs in, for README's support table
    default_backend: str  # the backend a Generator uses when none is named: one that needs no GPU
    # The pass that rewrites the canonical mixture-of-experts node (exporter/moe.py).
    moe_lowering: str = "kvforge.exporter.moe:lower_moe_to_plain"
    # ONNX Runtime's contrib fusions (normalization, rotary folded into the attention op), done at export.
    ort_fusions: bool = False
    quantize: bool = False  # `--quantize` (MatMulNBits) is an ONNX Runtime contrib op: ort only
    # `--kv-cache` dtypes its attention op reads and writes (ONNX Runtime's GroupQueryAttention takes an
    # int8 cache with per-channel scales; standard Attention + TensorScatter and the plugin do not).
    kv_cache_dtypes: tuple[str, ...] = ()
    # How many rows one prefill call may extend at past_lens > 0 (speculative verification, chunked
    # prefill); None: any. ONNX Runtime's GroupQueryAttention takes several new tokens after a past
    # only at batch 1.
    continue_batch: int | None = None
    # TensorRT engines (`kvforge build`): None if they cannot be built, else why not in a message.
    build_refusal: str | None = None
    # TensorRT's KV-cache-update layer (ONNX TensorScatter) needs the cache capacity static at build.
    static_engine_capacity: bool = False
    plugin: PluginIdentity | None = None  # the TensorRT plugin the target's graphs need
    needs_standard_tensorrt: bool = False  # TensorRT-RTX has no tensorrt.plugin to register it with
    # The export checks the model's attention shapes against kvforge's own kernel.
    kernel_shapes: bool = False
    # The head sizes the target's attention op takes are multiples of this (GroupQueryAttention: 8).
    head_dim_multiple: int = 1

    @property
    def buildable(self) -> bool:
        return self.build_refusal is None


TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            name="ort",
            summary="ONNX Runtime's com.microsoft.GroupQueryAttention (in place when past/present share one OrtValue)",
            lowering="kvforge.exporter.lowering:lower_to_ort",
            moe_lowering="kvforge.exporter.moe:lower_moe_to_ort",
            dtypes=tuple(DTYPES),
            support="fp32 and fp16 (CPU and CUDA), bf16 (CUDA); int4/int8 weights with `--quantize` "
                    "(measured on Llama and Qwen2); an int8 KV cache with `--kv-cache int8` (fp32, measured on CPU)",
            default_backend="ort-cpu",
            ort_fusions=True,
            quantize=True,
            kv_cache_dtypes=("int8",),
            continue_batch=1,
            head_dim_multiple=8,
            build_refusal="its attention is ONNX Runtime's GroupQueryAttention, which TensorRT does not import: "
                          "export with --target trt or --target onnx",
        ),
        Target(
            name="onnx",
            summary="standard ONNX Attention (opset 24) with TensorScatter for the in-place cache update",
            lowering="kvforge.exporter.lowering:lower_to_onnx",
            dtypes=tuple(DTYPES),
            support="fp32, fp16, bf16 (any runtime with opset-24 Attention and TensorScatter; TensorRT or "
                    "TensorRT-RTX engines through `kvforge build`)",
            default_backend="ort-cpu",
            static_engine_capacity=True,
        ),
        Target(
            name="trt",
            summary="kvforge's TensorRT plugin node, implemented by its Triton kernel",
            lowering="kvforge.exporter.lowering:lower_to_trt",
            dtypes=tuple(DTYPES),
            support="fp16, bf16 (standard TensorRT on a GPU; not with TensorRT-RTX); fp32 through the CPU emulation",
            default_backend="emulate",
            plugin=PLUGIN,
            needs_standard_tensorrt=True,
            kernel_shapes=True,
        ),
    )
}


def get_target(name: str) -> Target:
    """The registry entry of `name`, or InputError listing the targets."""
    try:
        return TARGETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None
