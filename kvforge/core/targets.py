"""The export targets as the runtime, the engine build and the CLI see them: what each target's attention
is, the dtypes it takes, what it runs in, which backend runs it by default, and what can be built from
it. The exporter's side of a target (its lowering passes, fusions and checks) is a module of
exporter/targets/. Nobody compares a target's name: they read these fields.

Adding a target: an entry here, a module in exporter/targets/ (registered there), and its name in the
entries of runtime/backends/backend.py's REGISTRY that run it.
Plain Python, so the runtime and the CLI can read it without the exporter's stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.core.contract import DTYPES, PLUGIN, PluginIdentity
from kvforge.core.errors import InputError


@dataclass(frozen=True)
class Target:
    name: str
    summary: str  # the attention op the target lowers to
    dtypes: tuple[str, ...]  # export dtypes the target accepts
    support: str  # what it runs in, for README's support table
    default_backend: str  # the backend a Generator uses when none is named: one that needs no GPU
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
    # Export dtypes ONNX Runtime's CUDA provider runs the target's attention in, and why not the others.
    cuda_dtypes: tuple[str, ...] = tuple(DTYPES)
    cuda_dtypes_why: str = ""

    @property
    def buildable(self) -> bool:
        return self.build_refusal is None


TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            name="ort",
            summary="ONNX Runtime's com.microsoft.GroupQueryAttention (in place when past/present share one OrtValue)",
            dtypes=tuple(DTYPES),
            support="fp32 and fp16 (CPU and CUDA), bf16 (CUDA); int4/int8 weights with `--quantize` (int4 fitted "
                    "with HQQ under 1B parameters, or calibrated with AutoRound), with fp32 activations (CPU) or `--dtype fp16`/`bf16` (ONNX "
                    "Runtime CUDA's `MatMulNBits`; run here on the CPU only) (measured on Llama, Qwen2, SmolLM2 and "
                    "Gemma 3); GPTQ, AWQ, compressed-tensors and AutoRound checkpoints and a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks "
                    "carried over bit for bit; an int8 KV cache with `--kv-cache int8` (fp32, measured on CPU)",
            default_backend="ort-cpu",
            continue_batch=1,
            cuda_dtypes=("fp16", "bf16"),
            cuda_dtypes_why="ONNX Runtime's CUDA GroupQueryAttention has fp16 and bf16 kernels only (fp32 would run "
                            "attention on the CPU, copying the cache every step)",
            build_refusal="its attention is ONNX Runtime's GroupQueryAttention, which TensorRT does not import: "
                          "export with --target trt or --target onnx",
        ),
        Target(
            name="onnx",
            summary="standard ONNX Attention (opset 24) with TensorScatter for the in-place cache update",
            dtypes=tuple(DTYPES),
            support="fp32, fp16, bf16 (any runtime with opset-24 Attention and TensorScatter; TensorRT or "
                    "TensorRT-RTX engines through `kvforge build`)",
            default_backend="ort-cpu",
            static_engine_capacity=True,
        ),
        Target(
            name="trt",
            summary="kvforge's TensorRT plugin node, implemented by its Triton kernel",
            dtypes=tuple(DTYPES),
            support="fp16, bf16 (standard TensorRT on a GPU; not with TensorRT-RTX); fp32 through the CPU emulation",
            default_backend="emulate",
            plugin=PLUGIN,
            needs_standard_tensorrt=True,
        ),
    )
}


def get_target(name: str) -> Target:
    """The registry entry of `name`, or InputError listing the targets."""
    try:
        return TARGETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None
