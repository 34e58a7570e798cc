"""Recurrences in a form the export can trace at any sequence length.

transformers' PyTorch fallbacks of some recurrent layers loop in Python over the sequence (the gated
DeltaNet's chunked form loops over chunks, then over the positions of a chunk): a trace then fixes the
sequence length to the example's. For the export's trace only, such a function is replaced by the same
recurrence written with `torch._higher_order_ops.scan`, which torch.onnx turns into one ONNX Scan over
the positions, so the prefill graph keeps a dynamic length and the decode graph is its one-step case.
The recurrences are the ones HF's own per-token forms compute, in fp32.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from kvforge.core.errors import UnsupportedModelError


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as HF's (and FLA's) l2norm


def scan_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                          output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                          **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over [B, S, H, D] inputs (HF's torch_chunk_gated_delta_rule's arguments and
    results; `chunk_size` is ignored): per position, the state [B, H, Dk, Dv] decays by exp(g), takes
    beta * (v - state^T k) along k, and the output is state^T q / sqrt(Dk). A gate g of [B, S, H, Dk] decays
    each key channel on its own (Kimi's delta attention, KDA)."""
    from torch._higher_order_ops.scan import scan

    dtype = query.dtype
    k_heads, v_heads = key.shape[2], value.shape[2]
    if k_heads != v_heads:  # grouped value heads: each key head serves v_heads // k_heads of them
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, g, beta = (x.to(torch.float32) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    batch, _, heads, k_dim = key.shape
    state = (initial_state.to(torch.float32) if initial_state is not None
             else query.new_zeros(batch, heads, k_dim, value.shape[-1]))

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, decay, b = xs  # [B, H, Dk], [B, H, Dk], [B, H, Dv], [B, H] (or [B, H, Dk]: KDA), [B, H]
        state = state * (decay.exp()[..., None, None] if decay.dim() == 2 else decay.exp()[..., None])
        remembered = (state * k[..., None]).sum(dim=-2)
        state = state + k[..., None] * ((v - remembered) * b[..., None])[..., None, :]
        return state, (state * q[..., None]).sum(dim=-2)

    final, out = scan(step, state, [x.transpose(0, 1) for x in (query, key, value, g, beta)])
    return out.transpose(0, 1).to(dtype), (final if output_final_state else None)


# The recurrent state the layer being traced read from the cache (exporter/wrapper.py's trace cache notes
# it): Mamba's sequence form takes no initial state (HF starts it at zero), but a prefill that continues
# a row (chunked prefill, a second turn) must start from the row's state. "heads": how many of its heads
# the layer has scanned so far (Zamba's mixer scans its heads one call each, in head order).
_READ: dict[str, Any] = {}


def note_recurrent_state(state: torch.Tensor | None) -> None:
    _READ["state"], _READ["heads"] = state, 0


def _state_read(inner: int, size: int) -> torch.Tensor | None:
    """The state (one row: [inner, size]) this scan starts from: the one the layer read, or, for a state kept
    by head ([B, heads, inner, size]: Zamba), the next head's slice, as HF's per-head loop hands them out."""
    read = _READ.get("state")
    if read is not None and read.dim() == 4 and tuple(read.shape[2:]) == (inner, size):
        head = _READ.get("heads", 0)
        if head >= read.shape[1]:
            raise UnsupportedModelError(f"its Mamba layer scans more heads than the {read.shape[1]} its state keeps")
        _READ["heads"] = head + 1
        return read[:, head].contiguous()  # scan wants its carry laid out as its own output
    if read is not None and tuple(read.shape[1:]) != (inner, size):
        raise UnsupportedModelError(f"its Mamba layer keeps a state of {tuple(read.shape[1:])} per row but scans "
                                    f"{(inner, size)} at a time, which kvforge's traced scan does not follow")
    return read


def scan_selective_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                        C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                        delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                        return_last_state: bool = False, **_: Any) -> Any:
    """Mamba's selective scan (HF's mamba_selective_scan's arguments and results: hidden_states and dt
    [B, I, S], A [I, N], B and C [B, N, S]), from the state the layer read (zeros where it read none; its
    head's slice where the layer keeps it by head and scans one head per call, as Zamba's): per position,
    state = exp(A dt) * state + dt B x, and the output is state C (+ D x, gated by silu(z))."""
    from torch._higher_order_ops.scan import scan

    dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [B, I, S, N]
    inflow = dt[:, :, :, None] * B.transpose(1, 2)[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    read = _state_read(inflow.shape[1], inflow.shape[3])
    state = read.float() if read is not None else inflow.new_zeros(inflow.shape[0], inflow.shape[1], inflow.shape[3])

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, bu, c = xs  # [B, I, N], [B, I, N], [B, N]
        state = a * state + bu
        return state, torch.matmul(state.to(dtype), c.to(dtype).unsqueeze(-1))[..., 0]

    final, out = scan(step, state, [decay.permute(2, 0, 1, 3), inflow.permute(2, 0, 1, 3), C.permute(2, 0, 1)])
    out = out.permute(1, 2, 0)  # [B, I, S]
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z)
    out = out.to(dtype)
    return (out, final) if return_last_state else out


def scan_mamba2(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int = 256, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
                **_: Any) -> Any:
    """Mamba 2's scan (HF's mamba2_chunk_scan's arguments and results: hidden_states [B, S, H, P], dt
    [B, S, H], A [H], B and C [B, S, G, N]; `chunk_size` is ignored), one position at a time: the chunked
    form's chunk count is a size the trace would fix when the example fits one chunk. Per position, the
    state [B, H, P, N] decays by exp(A dt) and takes dt x B; the output is state C + D x, in fp32."""
    from torch._higher_order_ops.scan import scan

    heads, groups = hidden_states.shape[2], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B, C = (t.float().repeat_interleave(heads // groups, dim=2, output_size=heads) for t in (B, C))
    decay = torch.exp(A.float() * dt)  # [B, S, H]
    state = (initial_states.float() if initial_states is not None
             else x.new_zeros(x.shape[0], heads, x.shape[3], B.shape[3]))

    def step(state: torch.Tensor, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x_t, dt_t, a_t, b_t, c_t = xs  # [B, H, P], [B, H], [B, H], [B, H, N], [B, H, N]
        state = state * a_t[..., None, None] + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        return state, (state * c_t[:, :, None, :]).sum(dim=-1)

    final, out = scan(step, state, [t.transpose(0, 1) for t in (x, dt, decay, B, C)])
    out = out.transpose(0, 1)  # [B, S, H, P]
    if D is not None:
        out = out + D[..., None] * x
    return (out, final) if return_final_states else out


# Module-level functions of transformers' modeling files, by name, and what the trace uses instead.
TRACEABLE = {"torch_chunk_gated_delta_rule": scan_gated_delta_rule, "chunk_kimi_delta_attention": scan_gated_delta_rule,
             "mamba_selective_scan": scan_selective_scan, "mamba2_chunk_scan": scan_mamba2}


@contextlib.contextmanager
def traceable_recurrences(model: torch.nn.Module) -> Iterator[list[str]]:
    """While tracing `model`, its modeling module's Python-looped recurrences are their scan forms (the
    names replaced are yielded); restored afterwards, so HF eager (the parity reference) is untouched."""
    module = sys.modules.get(type(model).__module__)
    replaced = {name: getattr(module, name) for name in TRACEABLE if module is not None and hasattr(module, name)}
    for name in replaced:
        setattr(module, name, TRACEABLE[name])
    # A scan whose inputs come from parameters that require grad fails torch.onnx's decomposition
    # ("'SymInt' object has no attribute 'unsqueeze'"); an export never trains.
    grads = [(param, param.requires_grad) for param in model.parameters()] if replaced else []
    for param, _ in grads:
        param.requires_grad_(False)
    try:
        yield sorted(replaced)
    finally:
        for name, original in replaced.items():
            setattr(module, name, original)
        _READ.clear()
        for param, flag in grads:
            param.requires_grad_(flag)
