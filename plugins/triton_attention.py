"""The fused KV-cache attention as one Triton kernel: append the new K/V rows and attend, in one launch.

Semantics are exactly plugins/reference.py's `kv_cache_attention`; the launcher writes the new rows
into `past_key`/`past_value` in place (they are the present caches afterwards) and returns `out`.

Design (launch arithmetic in plugins/attention_launch.py, shared with the AOT compiler):
- Grid (row blocks, batch * kv heads, splits). A "row" is a (token, query head of this KV head's
  group) pair, so the GQA group is packed into the M dimension of tl.dot: decode with a group of 8
  still gives the tensor cores 8 (padded to 16) rows sharing every K/V tile that is loaded.
- Keys are read from two sources, never from a row written in this launch: the cache prefix
  [0, past_len) from past_key/past_value, the new tokens [past_len, past_len + S) straight from the
  k/v inputs. Both run through one online-softmax loop body, unrolled over four static segments:
  each source's key tiles that every row may see (no masks), then its masked rest (partial tile,
  causal diagonal, sliding window).
- Append: the split-0 program of each (batch, kv head, row block) copies the new K/V rows of the
  tokens whose first row lies in its block into present_key/present_value. Exactly one program
  writes each row, and no program reads it, so there is no race.
- Split keys (flash-decoding): with NUM_SPLITS > 1 each program takes one slice of the key range,
  writes its partial (unnormalised acc, running max, running sum) to the workspace and increments
  the row block's counter; the program that arrives last merges all partials, writes `out` and
  resets the counter to 0, so a zero-initialised workspace stays valid for the next launch.

The kernel body is a plain function wrapped twice: as a JITFunction (compiled, CUDA tensors and the
AOT compiler) and as an InterpretedFunction (TRITON_INTERPRET semantics on CPU tensors). Triton picks
one of the two at decoration time from TRITON_INTERPRET; wrapping explicitly lets one process do both.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kvforge.core.contract import AttentionAttrs, attention_parameters, check_attention_parameters
from kvforge.plugins import attention_launch as launch

LOG2E = tl.constexpr(1.4426950408889634)

# The kernel calls only Triton builtins, never the @triton.jit helpers of triton.language.standard
# (tl.max, tl.sum, tl.cdiv, tl.zeros): those were wrapped for one mode when triton was imported and
# fail in the other. Row reductions go through the builtin tl.reduce with the standard library's own
# combine functions, which the interpreter recognises and runs as numpy reductions.


def _kv_cache_attention_kernel(
    q,
    k,
    v,
    past_key,
    past_value,
    past_lens,
    batch,
    seq_len,
    capacity,
    out,
    present_key,
    present_value,
    partials,
    counters,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    GROUP: tl.constexpr = NUM_HEADS // KV_HEADS
    Q_ROW: tl.constexpr = NUM_HEADS * HEAD_DIM  # elements per token in q / out
    KV_ROW: tl.constexpr = KV_HEADS * HEAD_DIM  # elements per token in k / v

    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // KV_HEADS
    kv_head = bh % KV_HEADS
    # Offsets of whole caches overflow int32 for large batch * capacity: do the bases in int64.
    b64 = b.to(tl.int64)
    past_len = tl.load(past_lens + b)

    offs_d = tl.arange(0, HEAD_DIM)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = tok < seq_len
    q_pos = past_len + tok  # cache position of each row's token

    q_offs = (b64 * seq_len + tok) * Q_ROW + head * HEAD_DIM
    q_tile = tl.load(q + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if DOT_FP32:
        # Interpreter only: its tl.dot multiplies bf16 bit patterns as integers. Upcasting is exact,
        # so the fp32 dot sees the same operand values as the tensor cores would.
        q_tile = q_tile.to(tl.float32)

    cache_base = (b64 * KV_HEADS + kv_head) * capacity * HEAD_DIM  # row 0 of this (b, kv head) cache
    input_base = b64 * seq_len * KV_ROW + kv_head * HEAD_DIM  # token 0 of this (b, kv head) in k / v

    # Append: split 0 copies the new rows of the tokens whose first row (t * GROUP) is in this block.
    if split == 0:
        w_first = (m_block * BLOCK_M + GROUP - 1) // GROUP
        w_end = tl.minimum((m_block * BLOCK_M + BLOCK_M + GROUP - 1) // GROUP, seq_len)
        w_tok = w_first + tl.arange(0, BLOCK_M)
        # The capacity check guards memory only; the launcher promises past_len + seq_len <= capacity.
        w_mask = ((w_tok < w_end) & (past_len + w_tok < capacity))[:, None]
        src = input_base + w_tok[:, None] * KV_ROW + offs_d[None, :]
        dst = cache_base + (past_len + w_tok)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(present_key + dst, tl.load(k + src, mask=w_mask), mask=w_mask)
        tl.store(present_value + dst, tl.load(v + src, mask=w_mask), mask=w_mask)

    # Key range of this row block: up to its last token (causal), from its first token's window.
    first_tok = (m_block * BLOCK_M) // GROUP
    last_tok = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, seq_len - 1)
    key_hi = past_len + last_tok + 1
    if WINDOW > 0:
        key_lo = tl.maximum(past_len + first_tok - WINDOW + 1, 0)
    else:
        key_lo = past_len * 0
    # This program's slice of the keys, a multiple of 16 positions (the last slices may be short or
    # empty). Not a multiple of BLOCK_N: a short cache split several ways still splits for real.
    per_split = (key_hi - key_lo + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (per_split + 15) // 16 * 16
    split_lo = key_lo + split * chunk
    split_hi = tl.minimum(split_lo + chunk, key_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)

    # Key segments. The cache prefix [0, past_len) is read from the cache (nobody writes those rows in
    # this launch; clamped to the capacity for safety), the new tokens [past_len, past_len + S) from
    # the k / v inputs (not from the cache rows being appended). Each comes as whole tiles that every
    # row of the block may see (no masks at all: the common case, kept cheap) and then the masked
    # rest: the partial last tile, the causal diagonal, the sliding window (which masks everything).
    cache_hi = tl.minimum(tl.minimum(split_hi, past_len), capacity)
    new_lo = tl.maximum(split_lo, past_len)
    if WINDOW > 0:
        cache_full = split_lo
        new_full = new_lo
    else:
        cache_full = split_lo + tl.maximum(cache_hi - split_lo, 0) // BLOCK_N * BLOCK_N
        # Every row's token is >= first_tok, so keys up to past_len + first_tok are visible to all.
        visible_hi = tl.minimum(split_hi, past_len + first_tok + 1)
        new_full = new_lo + tl.maximum(visible_hi - new_lo, 0) // BLOCK_N * BLOCK_N

    for segment in tl.static_range(4):  # odd segments are the masked ones
        if segment < 2:
            k_base = past_key + cache_base
            v_base = past_value + cache_base
            row_stride = HEAD_DIM
            seg_first = past_len * 0  # cache position of the segment's row 0
            if segment == 0:
                seg_lo = split_lo
                seg_hi = cache_full
            else:
                seg_lo = cache_full
                seg_hi = cache_hi
        else:
            k_base = k + input_base
            v_base = v + input_base
            row_stride = KV_ROW
            seg_first = past_len
            if segment == 2:
                seg_lo = new_lo
                seg_hi = new_full
            else:
                seg_lo = new_full
                seg_hi = split_hi
        for start in range(seg_lo, seg_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kv_offs = (pos - seg_first)[:, None] * row_stride + offs_d[None, :]
            if segment % 2 == 1:
                in_seg = pos < seg_hi
                k_tile = tl.load(k_base + kv_offs, mask=in_seg[:, None], other=0.0)
            else:
                k_tile = tl.load(k_base + kv_offs)
            if DOT_FP32:
                k_tile = k_tile.to(tl.float32)
            # ieee keeps fp32 inputs exact (no tf32); fp16 / bf16 inputs take the tensor cores as usual.
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * SCALE
            if SOFTCAP > 0.0:
                # softcap * tanh(s / softcap); tanh via exp2 so it saturates cleanly to +-1.
                t = tl.exp2(s * (2.0 * LOG2E / SOFTCAP))
                s = SOFTCAP * (1.0 - 2.0 / (t + 1.0))
            if segment % 2 == 1:
                allowed = in_seg[None, :] & (pos[None, :] <= q_pos[:, None])
                if WINDOW > 0:
                    allowed = allowed & (pos[None, :] > q_pos[:, None] - WINDOW)
                s = tl.where(allowed, s * LOG2E, float("-inf"))
            else:
                s = s * LOG2E
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            # A row with no allowed key yet keeps m = -inf; subtract 0 then, not -inf (NaN).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if segment % 2 == 1:
                v_tile = tl.load(v_base + kv_offs, mask=in_seg[:, None], other=0.0)
            else:
                v_tile = tl.load(v_base + kv_offs)
            p_in = p.to(v_tile.dtype)  # probabilities at the cache's precision, as flash attention does
            if DOT_FP32:
                p_in = p_in.to(tl.float32)
                v_tile = v_tile.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_in, v_tile, input_precision="ieee")
            m_i = m_new

    out_offs = q_offs[:, None] + offs_d[None, :]
    if NUM_SPLITS == 1:
        # Padding rows past the last token may have seen no key (l == 0); they are not stored anyway.
        normalised = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out + out_offs, normalised.to(out.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Flash-decoding combine inside the launch: publish this split's partial, count arrivals.
        RECORD: tl.constexpr = BLOCK_M * (HEAD_DIM + 2)
        tile = bh.to(tl.int64) * tl.num_programs(0) + m_block
        record = partials + (tile * NUM_SPLITS + split) * RECORD
        row_ids = tl.arange(0, BLOCK_M)
        tl.store(record + row_ids[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.store(record + BLOCK_M * HEAD_DIM + row_ids, m_i)
        tl.store(record + BLOCK_M * HEAD_DIM + BLOCK_M + row_ids, l_i)
        # All threads' stores before the (acq_rel, gpu-scope) atomic that releases them.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            # Last to arrive: every other split's partial is visible now. Merge them in split order.
            m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_all = tl.full([BLOCK_M], 0.0, tl.float32)
            acc_all = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
            first_record = partials + tile * NUM_SPLITS * RECORD
            for s_idx in range(NUM_SPLITS):
                rec = first_record + s_idx * RECORD
                # .cg: read from L2, never a stale L1 line of another SM's write.
                acc_s = tl.load(rec + row_ids[:, None] * HEAD_DIM + offs_d[None, :], cache_modifier=".cg")
                m_s = tl.load(rec + BLOCK_M * HEAD_DIM + row_ids, cache_modifier=".cg")
                l_s = tl.load(rec + BLOCK_M * HEAD_DIM + BLOCK_M + row_ids, cache_modifier=".cg")
                m_new = tl.maximum(m_all, m_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                w_old = tl.exp2(m_all - m_safe)
                w_s = tl.exp2(m_s - m_safe)
                acc_all = acc_all * w_old[:, None] + acc_s * w_s[:, None]
                l_all = l_all * w_old + l_s * w_s
                m_all = m_new
            normalised = acc_all / tl.where(l_all > 0.0, l_all, 1.0)[:, None]
            tl.store(out + out_offs, normalised.to(out.dtype.element_ty), mask=row_valid[:, None])
            # Leave the counter as the launch found it, for the next call over the same workspace.
            tl.store(counters + tile, 0)


KERNEL_NAME = _kv_cache_attention_kernel.__name__


@functools.cache
def compiled_kernel() -> triton.runtime.jit.JITFunction:
    """The kernel as a JITFunction (CUDA launches and ahead-of-time compilation), whatever TRITON_INTERPRET."""
    return triton.runtime.jit.JITFunction(_kv_cache_attention_kernel)


@functools.cache
def interpreted_kernel():
    """The kernel under Triton's interpreter (runs on CPU tensors), whatever TRITON_INTERPRET."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_kv_cache_attention_kernel)


def _interpret_env() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else False


# One zero-initialised workspace per device, grown on demand. The kernel leaves the counters at zero,
# so it is reused as is. Calls on one device must not overlap on different streams (they would share it).
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def get_workspace(device: torch.device, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials fp32, counters int32) with at least the given element counts, zeroed once."""
    have = _WORKSPACES.get(device)
    if have is None or have[0].numel() < partials or have[1].numel() < counters:
        old_p, old_c = have if have is not None else (None, None)
        new_p = max(partials, 1, old_p.numel() if old_p is not None else 0)
        new_c = max(counters, 1, old_c.numel() if old_c is not None else 0)
        have = (
            torch.zeros(new_p, dtype=torch.float32, device=device),
            torch.zeros(new_c, dtype=torch.int32, device=device),
        )
        _WORKSPACES[device] = have
    return have


# Configs shrunk to fit a device's shared memory, by (device, call shape and options).
_FITTED: dict[tuple, launch.KernelConfig] = {}


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=512)
def _plan(batch: int, seq: int, capacity: int, head_dim: int, attrs: AttentionAttrs, num_splits: int | None,
          block_m: int | None, block_n: int | None, config: launch.KernelConfig | None, num_sms: int,
          dot_fp32: bool) -> tuple[launch.KernelConfig, tuple[int, int, int], tuple[int, int], dict]:
    """Config, grid, workspace sizes and constexprs of a call; cached, as decode repeats the same shapes."""
    kv_num_heads = attrs.kv_num_heads
    group = attrs.num_heads // kv_num_heads
    if config is None:
        config = launch.choose_config(batch, seq, kv_num_heads, group, head_dim, capacity, num_splits, num_sms)
        for name, size in (("block_m", block_m), ("block_n", block_n)):
            if size is not None and (size < 16 or size & (size - 1)):
                raise ValueError(f"{name} must be a power of two >= 16; got {size}")
        config = dataclasses.replace(config, block_m=block_m or config.block_m, block_n=block_n or config.block_n)
    grid = launch.launch_grid(batch, seq, kv_num_heads, group, config.num_splits, config.block_m)
    workspace = launch.workspace_shape(batch, seq, kv_num_heads, group, head_dim, config.num_splits, config.block_m)
    consts = launch.constexprs(attrs, head_dim, config, dot_fp32)
    return config, grid, workspace, consts


def _check_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_key: torch.Tensor,
                     past_value: torch.Tensor, past_lens: torch.Tensor, attrs: AttentionAttrs) -> None:
    """Refuse, with the shapes, what the kernel would read or write out of bounds."""
    batch, seq, q_width = q.shape
    _, _, capacity, head_dim = past_key.shape
    num_heads, kv_num_heads = attrs.num_heads, attrs.kv_num_heads
    launch.check_shapes(num_heads, kv_num_heads, head_dim)
    if (
        q_width != num_heads * head_dim
        or k.shape != (batch, seq, kv_num_heads * head_dim)
        or k.shape != v.shape
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} with "
            f"num_heads={num_heads}, kv_num_heads={kv_num_heads}, head_dim={head_dim}"
        )
    if past_key.shape != (batch, kv_num_heads, capacity, head_dim) or past_value.shape != past_key.shape:
        raise ValueError(
            f"caches must be [B, Hkv, C, D]; got {tuple(past_key.shape)}, {tuple(past_value.shape)}"
        )
    if not (past_key.is_contiguous() and past_value.is_contiguous()):
        raise ValueError("past_key/past_value must be contiguous: the kernel writes the new rows in place")
    if len({q.dtype, k.dtype, v.dtype, past_key.dtype, past_value.dtype}) != 1:
        raise ValueError("q, k, v and the caches must share one dtype")
    if past_lens.shape != (batch,):
        raise ValueError(f"past_lens must be [B]; got {tuple(past_lens.shape)}")
    if past_lens.device.type == "cpu" and int(past_lens.max()) + seq > capacity:
        raise ValueError(f"past_lens + S exceeds the cache capacity {capacity}")


def kv_cache_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_lens: torch.Tensor,
    attrs: AttentionAttrs,
    *,
    num_splits: int | None = None,
    interpret: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    config: launch.KernelConfig | None = None,
) -> torch.Tensor:
    """Append k/v into past_key/past_value in place (rows past_lens[b] + t) and return the attention output.

    q [B, S, H*D], k/v [B, S, Hkv*D] (H, Hkv: attrs.num_heads, attrs.kv_num_heads), past_key/past_value
    [B, Hkv, C, D] contiguous, past_lens [B]
    int32 with past_lens + S <= C (checked on CPU tensors; on the GPU the kernel only masks writes
    past the capacity, it does not sync to check). `num_splits` forces the key split count (None:
    from the shapes). `interpret` picks Triton's interpreter (default: for CPU tensors, or when
    TRITON_INTERPRET is set). `block_m` / `block_n` override the tile sizes (powers of two >= 16) and
    `config` every launch choice, for tests and tuning.
    """
    _check_arguments(q, k, v, past_key, past_value, past_lens, attrs)
    batch, seq, _ = q.shape
    _, _, capacity, head_dim = past_key.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    past_lens = past_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if batch == 0 or seq == 0:
        return out

    device = q.device
    if interpret is None:
        interpret = device.type == "cpu" or _interpret_env()
    num_sms = _num_sms(device) if device.type == "cuda" else launch.DEFAULT_NUM_SMS
    # The interpreter's tl.dot mishandles bf16 (see the kernel); the compiled kernel never upcasts.
    dot_fp32 = interpret and q.dtype == torch.bfloat16
    plan_key = (batch, seq, capacity, head_dim, attrs, num_splits, block_m, block_n)
    config = _FITTED.get((device, plan_key), config)
    kernel = interpreted_kernel() if interpret else compiled_kernel()
    while True:
        config, grid, workspace, consts = _plan(*plan_key, config, num_sms, dot_fp32)
        partials, counters = get_workspace(device, *workspace)
        try:
            kernel[grid](
                q,
                k,
                v,
                past_key,
                past_value,
                past_lens,
                *launch.scalar_args(batch, seq, capacity),
                out,
                past_key,  # present_key: the same memory, written in place
                past_value,
                partials,
                counters,
                **consts,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
            return out
        except OutOfResources:
            # More shared memory than this GPU offers (sm_86 / sm_89: 99 KiB): the launch was refused
            # before anything ran, so retry smaller and remember the fit for this device and shape.
            config = launch.shrink_config(config)
            if config is None:
                raise
            _FITTED[(device, plan_key)] = config


def run_interpreted(*args, **kwargs) -> torch.Tensor:
    """`kv_cache_attention_triton` under Triton's interpreter (CPU tensors), whatever TRITON_INTERPRET."""
    return kv_cache_attention_triton(*args, interpret=True, **kwargs)


check_attention_parameters(_kv_cache_attention_kernel, launch.KERNEL_PARAMS)
check_attention_parameters(kv_cache_attention_triton, attention_parameters(spelled=False))
