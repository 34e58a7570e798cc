"""DBRX: its experts are a Python loop over the experts a batch picked (a data-dependent loop torch.export cannot
trace), with their weights in its own layout; the export reads them into the canonical MoE node's layout
(exporter/experts_routing.py)."""

from __future__ import annotations

from typing import Any

from kvforge.models.families.family import Family, LoopedExperts


def _experts(module: Any) -> LoopedExperts | None:
    if type(module).__name__ != "DbrxExperts":
        return None
    mlp = module.mlp
    shape = (module.num_experts, module.ffn_hidden_size, module.hidden_size)
    # w2 is [E*I, H], applied as x @ w2: down[e] = w2[e].T. DBRX returns [batch, -1, H] from [batch, ..., H].
    return LoopedExperts(mlp.w1.detach().view(shape), mlp.v1.detach().view(shape),
                         mlp.w2.detach().view(shape).transpose(1, 2), 0, mlp.activation_fn,
                         ((mlp, "w1"), (mlp, "v1"), (mlp, "w2")), batch_first=True)


FAMILIES = (Family("dbrx", (), "experts looped over the picked ones, read into the MoE node", looped_experts=_experts),)
