"""LongCat-Flash: its experts are a loop over the experts a batch picked, with zero-computation identity experts
(ids from the routed count on: output = input) beside the routed ones; the export reads the routed experts into
the canonical MoE node's layout and adds the identity experts' weight times the input
(exporter/experts_routing.py)."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family, LoopedExperts


def _experts(module: Any) -> LoopedExperts | None:
    if type(module).__name__ != "LongcatFlashExperts":
        return None
    routed = module.num_routed_experts
    # gate_up_proj holds total_experts rows, the identity experts' unused: [gate; up] per routed expert.
    gate, up = module.gate_up_proj.detach()[:routed].chunk(2, dim=1)
    return LoopedExperts(gate, up, module.down_proj.detach(), module.zero_expert_num, module.act_fn,
                         ((module, "gate_up_proj"), (module, "down_proj")))


FAMILIES = (Family("longcat_flash", (), "looped experts with identity experts, read into the MoE node",
                   looped_experts=_experts),)
