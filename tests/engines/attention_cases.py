"""The shape grid of the attention kernel tests, shared by the CPU (interpreter) and GPU test files.

Each case runs the Triton kernel and the torch reference (plugins/reference.py) on the same poisoned
caches and compares the output (per-dtype tolerance) and both whole caches (exactly).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kvforge.core.contract import AttentionAttrs
from kvforge.plugins import attention_launch as launch
from kvforge.plugins import triton_attention as ta
from kvforge.plugins.reference import kv_cache_attention

# Max |kernel - reference| allowed, as (atol, rtol), by activation dtype. The reference computes in
# fp32 from the same low-precision inputs and rounds once at the end; the kernel also rounds the
# probabilities to the cache dtype before P @ V (as flash attention does), so low precision gets about
# one output ulp of slack. Worst errors measured on this grid under the interpreter: fp32 2e-6,
# fp16 ~1e-3 (1 ulp at |out| in [1, 2)), bf16 ~1.6e-2 (2 ulp at [1, 2)).
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq: int
    num_heads: int
    kv_heads: int
    head_dim: int
    capacity: int
    past_lens: tuple[int, ...]
    dtype: str = "fp32"
    softcap: float = 0.0
    window: int = 0
    num_splits: int | None = None  # None: the launcher's choice (1 on these short caches)
    block_m: int | None = None
    block_n: int | None = None


CASES = [
    # Prefill without a past, MHA: 24 tokens, causal over the new tokens only.
    Case("mha-prefill-nopast", 2, 24, 4, 4, 64, 32, (0, 0)),
    # Chunked prefill (prefill with a past); row 1 fills the cache exactly (33 + 7 == 40).
    Case("gqa4-chunked-prefill-d128", 2, 7, 8, 2, 128, 40, (5, 33)),
    # Decode, GQA 8, with and without the in-launch split combine; row 1 exactly full.
    Case("gqa8-decode-d64", 2, 1, 16, 2, 64, 64, (17, 63), num_splits=1),
    Case("gqa8-decode-d64-split4", 2, 1, 16, 2, 64, 64, (17, 63), num_splits=4),
    # MQA decode, three rows (empty past, middle, exactly full), an odd split count.
    Case("mqa-decode-d32-split3", 3, 1, 8, 1, 32, 80, (0, 40, 79), num_splits=3),
    # The tiny test models' head_dim 16.
    Case("d16-prefill-past", 2, 9, 4, 2, 16, 24, (3, 15)),
    # GQA 3: a token's rows straddle row blocks of 16; several key tiles of 16.
    Case("gqa3-straddling-blocks", 2, 13, 6, 2, 32, 40, (2, 27), block_m=16, block_n=16),
    # Two row blocks of 128 (GQA 8 x 24 tokens), key tiles of 16.
    Case("gqa8-prefill-two-row-blocks", 1, 24, 16, 2, 64, 48, (10,), block_m=128, block_n=16),
    # Row blocks starting on every other token: the unmasked key tiles end right at the diagonal.
    Case("gqa8-diagonal-tiles", 2, 16, 8, 1, 32, 24, (0, 5), block_m=16, block_n=16),
    # A window reaching far back into the cache: whole cache tiles inside it must still be masked.
    Case("window-long-past", 2, 8, 4, 2, 32, 72, (60, 30), window=40, block_n=16),
    # Sliding window shorter than the sequence, prefill with and without a past.
    Case("window5-prefill", 2, 20, 4, 2, 64, 40, (0, 12), window=5, block_n=16),
    # Window and softcap on split decode: the window starts inside the key range.
    Case("window-softcap-decode-split2", 2, 1, 8, 2, 64, 80, (50, 79), softcap=2.0, window=24, num_splits=2),
    Case("softcap-prefill", 2, 10, 8, 4, 64, 30, (4, 20), softcap=2.0),
    # A few tokens per step (speculative verification) with splits.
    Case("gqa4-multitoken-split4", 2, 4, 8, 2, 64, 80, (30, 76), num_splits=4, block_n=16),
    # Low precision.
    Case("gqa4-prefill-fp16", 2, 16, 8, 2, 128, 40, (0, 24), dtype="fp16"),
    Case("gqa4-prefill-bf16", 2, 16, 8, 2, 128, 40, (0, 24), dtype="bf16"),
    Case("gqa8-decode-split4-fp16", 2, 1, 16, 2, 64, 64, (17, 63), dtype="fp16", num_splits=4),
    Case("gqa8-decode-split4-bf16", 2, 1, 16, 2, 64, 64, (17, 63), dtype="bf16", num_splits=4),
    Case("window-softcap-prefill-bf16", 2, 12, 4, 2, 64, 40, (0, 28), dtype="bf16", softcap=2.0, window=7),
]

# GQA ratio x head_dim cross product: chunked prefill and split decode for each, dtypes rotating.
for (group, head_dim), dtype in zip(
    itertools.product((1, 4, 8), (64, 128, 256)), itertools.cycle(("fp32", "fp16", "bf16", "fp32"))
):
    kv = 2 if group < 8 else 1
    CASES.append(
        Case(f"g{group}-d{head_dim}-chunked-{dtype}", 2, 6, group * kv, kv, head_dim, 32, (9, 26), dtype)
    )
    CASES.append(
        Case(
            f"g{group}-d{head_dim}-decode-split2-{dtype}",
            2,
            1,
            group * kv,
            kv,
            head_dim,
            48,
            (40, 47),
            dtype,
            num_splits=2,
        )
    )


def make_inputs(case: Case, device: str | torch.device, seed: int = 0) -> dict:
    """Random q/k/v and caches poisoned with random data (never zeros), on `device`."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    d = case.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return {
        "q": rand(case.batch, case.seq, case.num_heads * d),
        "k": rand(case.batch, case.seq, case.kv_heads * d),
        "v": rand(case.batch, case.seq, case.kv_heads * d),
        "past_key": rand(case.batch, case.kv_heads, case.capacity, d),
        "past_value": rand(case.batch, case.kv_heads, case.capacity, d),
        "past_lens": torch.tensor(case.past_lens, dtype=torch.int32, device=device),
    }


def check_case(case: Case, device: str | torch.device, interpret: bool, seed: int = 0) -> float:
    """Run kernel and reference, assert output / caches / workspace; returns max |out - ref|."""
    inputs = make_inputs(case, device, seed)
    scale = 1.0 / math.sqrt(case.head_dim)
    attrs = AttentionAttrs(case.num_heads, case.kv_heads, scale, case.softcap, case.window)
    ref_out, ref_key, ref_value = kv_cache_attention(*inputs.values(), attrs)

    if case.num_splits and case.num_splits > 1:
        # Poison the split partials: the combine must read only what this launch wrote.
        group = case.num_heads // case.kv_heads
        config = launch.choose_config(
            case.batch, case.seq, case.kv_heads, group, case.head_dim, case.capacity, case.num_splits
        )
        block_m = case.block_m or config.block_m
        sizes = launch.workspace_shape(
            case.batch, case.seq, case.kv_heads, group, case.head_dim, case.num_splits, block_m
        )
        partials, _ = ta.get_workspace(torch.device(device), *sizes)
        partials.fill_(float("nan"))

    key, value = inputs["past_key"].clone(), inputs["past_value"].clone()
    out = ta.kv_cache_attention_triton(
        inputs["q"], inputs["k"], inputs["v"], key, value, inputs["past_lens"], attrs,
        num_splits=case.num_splits, interpret=interpret, block_m=case.block_m, block_n=case.block_n,
    )  # fmt: skip

    # The caches: new rows at past_lens + t, every other (poisoned) row untouched, bit for bit.
    assert torch.equal(key, ref_key), "present_key differs from the reference"
    assert torch.equal(value, ref_value), "present_value differs from the reference"
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    atol, rtol = TOLERANCES[ref_out.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    # The last split program of each row block resets its counter for the next call.
    for _, counters in ta._WORKSPACES.values():
        assert int(counters.abs().sum()) == 0, "workspace counters not reset"
    return float((out.float() - ref_out.float()).abs().max())
