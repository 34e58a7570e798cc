"""HF's experts modules routed through the canonical MoE op (plugins/moe_op.py) for export.

transformers' MoE blocks call their experts module with the router's top-k ids and weights; `prepare_experts`
gives each module whose gate the op models its weights in the op's layout and makes "kvforge" (registered
here in transformers' ALL_EXPERTS_FUNCTIONS) the model's experts implementation, and `prepare_looped_experts`
does the same for experts written as a Python loop (a family's `looped_experts`, models/families/). Both act on
an export's `patches`, so the model is as it was once the export closes. Experts whose gate is not of the op's
form keep transformers' `batched_mm` implementation (the same gather form, traced)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

from kvforge.plugins.moe_op import activation  # importing it registers torch.ops.kvforge.moe_experts

EXPERTS_IMPLEMENTATION = "kvforge"
_CANONICAL = "_kvforge_moe"  # the attribute a prepared experts module holds its MoEAttrs in


# -- routing HF's experts modules through the node ---------------------------------------------------
def _kvforge_experts(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    attrs = getattr(module, _CANONICAL, None)
    if attrs is None:  # a gate the node does not model: the traced gather form
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    biases = (module.kvforge_gate_up_bias, module.kvforge_down_bias) if module.has_bias else (None, None)
    return torch.ops.kvforge.moe_experts(hidden_states, top_k_index.to(torch.int64), top_k_weights,
                                         module.kvforge_gate_up, module.kvforge_down, *biases, *attrs)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _kvforge_experts)


def _gate_form(module: torch.nn.Module, width: int) -> tuple[float, float, float] | None:
    """(alpha, beta, limit) such that the module's own gate equals the node's activation on the
    interleaved layout, checked on random inputs; None if no such form matches."""
    candidates = [(1.0, 0.0, 0.0)]
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, float) and isinstance(limit, (int, float)):
        candidates.append((alpha, 1.0, float(limit)))  # gpt-oss: clamped, (up + 1)
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(16, 2 * width, generator=generator) * 4.0
    with torch.no_grad():
        theirs = module._apply_gate(probe)
        # Their layout -> the node's interleaved one.
        ours = probe if not module.is_concatenated else torch.stack(probe.chunk(2, dim=-1), dim=-1).flatten(-2)
        for form in candidates:
            if torch.allclose(activation(ours, *form), theirs, atol=1e-5, rtol=1e-5):
                return form
    return None


def set_experts_implementation(model: torch.nn.Module, implementation: str, patches: Any) -> None:
    """The model's experts implementation, set back to the one it had when `patches` closes."""
    previous = model.config._experts_implementation
    model.set_experts_implementation(implementation)
    patches.callback(model.set_experts_implementation, previous)


def prepare_experts(model: torch.nn.Module, patches: Any) -> dict[str, int]:
    """Route the model's experts modules through the canonical node where their gate is SwiGLU-like:
    each gets its weights in the node's layout (buffers, so the graph reads them as initializers) and
    the model's experts implementation becomes "kvforge", all on the export's `patches`. Returns how many
    modules went each way."""
    counts = {"node": 0, "batched_mm": 0}
    for module in model.modules():
        if not hasattr(module, "has_gate") or not hasattr(module, "down_proj"):
            continue
        form = None
        if module.has_gate and not module.has_post_expert_norm:
            gate_up = module.gate_up_proj.detach()
            if module.is_transposed:  # [E, H, 2I] -> [E, 2I, H]
                gate_up = gate_up.transpose(1, 2)
            form = _gate_form(module, gate_up.shape[1] // 2)
        if form is None:
            counts["batched_mm"] += 1
            continue
        down = module.down_proj.detach()
        down = down.transpose(1, 2) if module.is_transposed else down
        bias = module.gate_up_proj_bias.detach() if module.has_bias else None
        if module.is_concatenated:  # [gate; up] -> gate_0, up_0, gate_1, up_1, ...
            gate_up = torch.stack(gate_up.chunk(2, dim=1), dim=2).flatten(1, 2)
            bias = torch.stack(bias.chunk(2, dim=1), dim=2).flatten(1, 2) if bias is not None else None
        patches.buffer(module, "kvforge_gate_up", gate_up.contiguous())
        patches.buffer(module, "kvforge_down", down.contiguous())
        if bias is not None:
            patches.buffer(module, "kvforge_gate_up_bias", bias.contiguous())
            patches.buffer(module, "kvforge_down_bias", module.down_proj_bias.detach().contiguous())
        patches.set(module, _CANONICAL, form)
        # The module now reads only the node's copies: drop its own, so an export holds its experts once.
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if name in module._parameters:
                patches.delete_parameter(module, name)
        counts["node"] += 1
    if counts["node"]:
        set_experts_implementation(model, EXPERTS_IMPLEMENTATION, patches)
    return counts


# -- experts modules that loop over the experts a batch hits -----------------------------------------
# Some families write their experts as a Python loop over the experts the batch picked (a data-dependent
# loop torch.export cannot trace) and keep their weights in their own layout. Their family's
# `looped_experts` reads a module's weights into the node's layout (models/families/family.py's
# LoopedExperts); the module then runs the node over its routed experts, and identity experts (LongCat-
# Flash's zero-computation experts: ids from E on, output = input) add their weight times the input.
def _looped_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    hidden = hidden_states.reshape(-1, module.kvforge_gate_up.shape[-1])
    index = top_k_index.to(torch.int64)
    routed = module.kvforge_gate_up.shape[0]
    out = None
    if module.kvforge_identity_experts:
        is_routed = index < routed
        # An identity expert's pick runs expert 0 at weight 0 in the node and adds weight x input here.
        identity_weight = torch.where(is_routed, torch.zeros_like(top_k_weights), top_k_weights).sum(-1, keepdim=True)
        out = hidden * identity_weight.to(hidden.dtype)
        index = torch.where(is_routed, index, torch.zeros_like(index))
        top_k_weights = torch.where(is_routed, top_k_weights, torch.zeros_like(top_k_weights))
    y = torch.ops.kvforge.moe_experts(hidden, index, top_k_weights, module.kvforge_gate_up, module.kvforge_down,
                                      None, None, 1.0, 0.0, 0.0)
    y = y if out is None else y + out
    # DBRX returns [batch, -1, H] from [batch, ..., H]; LongCat the shape it was given.
    return y.view(hidden_states.shape[0], -1, y.shape[-1]) if module.kvforge_batch_first else y.view_as(hidden_states)


def _is_silu(act: Any) -> bool:
    probe = torch.linspace(-8.0, 8.0, 101)
    with torch.no_grad():
        return bool(torch.allclose(act(probe), torch.nn.functional.silu(probe), atol=1e-6))


def looped_experts_count(model: torch.nn.Module, family: Any) -> int:
    """How many experts modules prepare_looped_experts would route (it rebuilds their weights from values)."""
    if family.looped_experts is None:
        return 0
    return sum(family.looped_experts(module) is not None for module in model.modules())


def prepare_looped_experts(model: torch.nn.Module, family: Any, patches: Any) -> int:
    """Route experts modules written as a loop over the experts a batch hits (the family's `looped_experts`) through
    the canonical node, where their gate is SiLU: their forward becomes the node over the routed experts (plus
    the identity experts' weighted input), on the export's `patches`. Returns how many modules were routed."""
    count = 0
    for module in list(model.modules()) if family.looped_experts is not None else ():
        read = family.looped_experts(module)
        if read is None or getattr(module, _CANONICAL, None) is not None:
            continue
        if not _is_silu(read.activation):
            continue  # the node models SiLU gating only; the module stays as written (and fails to trace)
        # Interleaved: gate_0, up_0, gate_1, ...
        patches.buffer(module, "kvforge_gate_up", torch.stack((read.gate, read.up), dim=2).flatten(1, 2).contiguous())
        patches.buffer(module, "kvforge_down", read.down.contiguous())
        patches.set(module, "kvforge_identity_experts", read.identity)
        patches.set(module, "kvforge_batch_first", read.batch_first)
        patches.set(module, _CANONICAL, (1.0, 0.0, 0.0))
        patches.set(module, "forward", _looped_forward.__get__(module))
        for owner, name in read.parameters:  # the module's own copies: an export holds its experts once
            if name in owner._parameters:
                patches.delete_parameter(owner, name)
        count += 1
    return count
