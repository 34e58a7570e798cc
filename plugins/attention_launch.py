"""Launch arithmetic of the fused attention kernel, in plain Python (no torch, no triton).

The torch launcher (plugins/triton_attention.py), the ahead-of-time compiler (plugins/ptx.py) and a
TensorRT plugin all need the same answers to "which compile-time constants, which block sizes, how
many key splits, which grid, how big a workspace, which parameter order"; they live here so each can
import them without the GPU stack.

Kernel parameters, in order (TensorRT's ahead-of-time path wants inputs, extra scalars, outputs):

  inputs    q, k, v, past_key, past_value, past_lens        pointers
  scalars   batch, seq_len, capacity                        int32, taken from the shapes at run time
                                                            (batch is carried by grid y; the kernel
                                                            does not read it)
  outputs   out, present_key, present_value                 pointers; present_* alias past_* in place
  workspace partials (fp32), counters (int32)               pointers; unused when num_splits == 1
  constexpr NUM_HEADS, KV_HEADS, HEAD_DIM, SCALE, SOFTCAP, WINDOW, BLOCK_M, BLOCK_N, NUM_SPLITS,
            DOT_FP32 (interpreter only: upcast bf16 dot operands, see the kernel)

The constexprs are compiled into the PTX (TensorRT does not serialise plugin attributes into an
engine), so one PTX serves every batch size, sequence length and cache capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvforge.core.contract import ATTENTION_INPUTS, ATTENTION_OUTPUTS, PAST_LENS, AttentionAttrs

INPUT_PARAMS = ATTENTION_INPUTS
SCALAR_PARAMS = ("batch", "seq_len", "capacity")
OUTPUT_PARAMS = ATTENTION_OUTPUTS
WORKSPACE_PARAMS = ("partials", "counters")
CONSTEXPR_PARAMS = (
    "NUM_HEADS",
    "KV_HEADS",
    "HEAD_DIM",
    "SCALE",
    "SOFTCAP",
    "WINDOW",
    "BLOCK_M",
    "BLOCK_N",
    "NUM_SPLITS",
    "DOT_FP32",
)
# Every runtime parameter of the kernel, in order; the constexprs follow them in the Python signature.
RUNTIME_PARAMS = INPUT_PARAMS + SCALAR_PARAMS + OUTPUT_PARAMS + WORKSPACE_PARAMS
# What TensorRT's ahead-of-time plugin launch passes (plugin inputs, extra scalar args, plugin outputs):
# the TensorRT variant is compiled without the workspace (num_splits=1).
TENSORRT_PARAMS = INPUT_PARAMS + SCALAR_PARAMS + OUTPUT_PARAMS
KERNEL_PARAMS = RUNTIME_PARAMS + CONSTEXPR_PARAMS

# Triton's pointer type names, by the activation dtype's name (torch or numpy spelling).
TRITON_DTYPES = {
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
}

# Splitting the key range pays off only when the programs without it would leave SMs idle and each
# split still has a few key tiles to stream; H100 SXM has 132 SMs.
DEFAULT_NUM_SMS = 132
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


# Dynamic shared memory a block may opt into, by compute capability (CUDA programming guide). The
# consumer parts (sm_86, sm_89, sm_120) have far less than the data-centre ones.
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def max_shared_bytes(arch: int) -> int:
    """Opt-in shared memory per block for compute capability `arch` (e.g. 86); conservative if unknown."""
    return MAX_SHARED_BYTES.get(arch, 101376)


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch options of one kernel variant (all compile-time)."""

    block_m: int  # packed (token, query head) rows per program; >= 16 for tl.dot
    block_n: int  # keys per inner-loop tile
    num_splits: int  # programs sharing one row block's key range (flash-decoding)
    num_warps: int
    num_stages: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_shapes(num_heads: int, kv_num_heads: int, head_dim: int) -> int:
    """Validate the head layout the kernel supports; returns the GQA group size."""
    if kv_num_heads <= 0 or num_heads <= 0 or num_heads % kv_num_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of kv_num_heads ({kv_num_heads})"
        )
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim must be a power of two in [16, 256] for the Triton kernel; got {head_dim}"
        )
    return num_heads // kv_num_heads


def choose_num_splits(
    batch: int,
    seq: int,
    kv_heads: int,
    group: int,
    capacity: int,
    block_m: int,
    num_sms: int = DEFAULT_NUM_SMS,
) -> int:
    """Key splits per row block: 1 for prefill and short caches, else enough programs to fill the GPU.

    The cache capacity stands in for the key length (past_lens lives on the device; reading it would
    cost a host sync per layer). A power of two keeps the number of compiled variants small.
    """
    programs = cdiv(seq * group, block_m) * batch * kv_heads
    limit = min(capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    if programs >= num_sms or limit < 2:
        return 1
    want = min(cdiv(num_sms, programs), limit)
    # The nearest power of two (ties up): on an H100, 8 programs x 16 splits beat 8 x 32 at 8k-32k
    # keys, and 64 x 4 beat 64 x 2 at 1k.
    splits = 1 << (want.bit_length() - 1)
    if 2 * splits <= limit and want - splits >= 2 * splits - want:
        splits *= 2
    return splits


def choose_config(
    batch: int,
    seq: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    capacity: int,
    num_splits: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> KernelConfig:
    """Pick block sizes for a call's shapes (decode: small row blocks; prefill: flash-attention tiles)."""
    rows = seq * group
    if rows <= 64:
        # Decode and short chunks: one row block holds the whole GQA group of a few tokens; the key
        # range is split across programs instead (flash-decoding).
        block_m = max(16, _next_pow2(rows))
        block_n, num_warps, num_stages = (32, 4, 2) if head_dim > 128 else (64, 4, 3)
    elif head_dim <= 64:
        block_m, block_n, num_warps, num_stages = 64, 64, 4, 3
    elif head_dim <= 128:
        # Big tiles pay once there are a few waves of programs (H100: 315 vs 303 TFLOP/s at 4k).
        waves = cdiv(rows, 128) * batch * kv_heads / num_sms
        block_m, block_n, num_warps, num_stages = (128, 64, 8, 3) if waves >= 4 else (64, 64, 4, 3)
    else:
        block_m, block_n, num_warps, num_stages = 128, 32, 8, 2
    if num_splits is None:
        num_splits = choose_num_splits(batch, seq, kv_heads, group, capacity, block_m, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    return KernelConfig(block_m, block_n, num_splits, num_warps, num_stages)


def shrink_config(config: KernelConfig) -> KernelConfig | None:
    """The next smaller-footprint config when a variant needs more shared memory than the GPU has
    (fewer pipeline stages first, then narrower key tiles, then fewer rows); None at the floor."""
    if config.num_stages > 2:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 32:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 64:
        return replace(config, block_m=config.block_m // 2, num_warps=4)
    if config.num_stages > 1:
        return replace(config, num_stages=1)
    return None


def launch_grid(
    batch: int, seq: int, kv_heads: int, group: int, num_splits: int, block_m: int
) -> tuple[int, int, int]:
    """(row blocks, batch * kv heads, splits): x has the large limit, y and z stay small."""
    return cdiv(seq * group, block_m), batch * kv_heads, num_splits


def workspace_shape(
    batch: int, seq: int, kv_heads: int, group: int, head_dim: int, num_splits: int, block_m: int
) -> tuple[int, int]:
    """(fp32 partials, int32 counters) element counts; (0, 0) when num_splits == 1.

    Per (row block, split): the unnormalised accumulator [block_m, head_dim], then the running max
    and sum [block_m] each. One counter per (batch, kv head, row block). The counters must be zero
    before the first launch; the kernel leaves them zero again.
    """
    if num_splits == 1:
        return 0, 0
    tiles = cdiv(seq * group, block_m) * batch * kv_heads
    return tiles * num_splits * block_m * (head_dim + 2), tiles


def workspace_bytes(
    batch: int, seq: int, kv_heads: int, group: int, head_dim: int, num_splits: int, block_m: int
) -> int:
    partials, counters = workspace_shape(batch, seq, kv_heads, group, head_dim, num_splits, block_m)
    return 4 * partials + 4 * counters


def constexprs(
    attrs: AttentionAttrs, head_dim: int, config: KernelConfig, dot_fp32: bool = False
) -> dict[str, int | float]:
    """The compile-time constants of one variant, by parameter name (dot_fp32: for the interpreter only):
    the op's attributes become the kernel's constants here and nowhere else."""
    check_shapes(attrs.num_heads, attrs.kv_num_heads, head_dim)
    return {
        "NUM_HEADS": int(attrs.num_heads),
        "KV_HEADS": int(attrs.kv_num_heads),
        "HEAD_DIM": int(head_dim),
        "SCALE": float(attrs.scale),
        "SOFTCAP": float(attrs.softcap),
        "WINDOW": int(attrs.sliding_window),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "NUM_SPLITS": config.num_splits,
        "DOT_FP32": bool(dot_fp32),
    }


def signature(dtype: str) -> dict[str, str]:
    """Triton type of each runtime parameter (for ASTSource), by parameter name, in kernel order."""
    try:
        ty = TRITON_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of float16, bfloat16, float32") from None
    # Activations and caches in the op's dtype, the lengths int32, the workspace (partials, counters) fp32 / int32.
    types = {name: f"*{ty}" for name in INPUT_PARAMS + OUTPUT_PARAMS}
    types[PAST_LENS] = "*i32"
    types.update(dict(zip(WORKSPACE_PARAMS, ("*fp32", "*i32"), strict=True)))
    types.update({name: "i32" for name in SCALAR_PARAMS})
    return {name: types[name] for name in RUNTIME_PARAMS}


def scalar_args(batch: int, seq: int, capacity: int) -> tuple[int, int, int]:
    """The int32 scalars, in kernel order."""
    return batch, seq, capacity
