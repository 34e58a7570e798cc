"""Lowering: rewrite each canonical attention node (kvforge.core.contract.CANONICAL_OP) and each canonical
MoE node with the passes of the export's target (exporter/targets/: ort, onnx, trt), then drop what the
rewrite left unused.

Values that depend only on `past_lens` and the shapes (lengths, causal mask) are built once per graph
and shared by every layer's node.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.core.errors import ExportError
from kvforge.exporter.graph_edit import DOMAIN, canonical_nodes
from kvforge.exporter.targets import ExportTarget


def lower(model: ir.Model, target: ExportTarget, rotary: tuple[np.ndarray, np.ndarray] | None = None,
          kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
          moe_quantize: tuple[int, int] | None = None, attends: bool = True) -> ir.Model:
    """Rewrite every canonical node of `model` in place with `target`'s passes. `rotary`: the model's
    cos/sin caches, which targets with ONNX Runtime's fusions fold into their attention op; `kv_scales`:
    a quantised cache's scales per layer (targets whose `kv_cache_dtypes` name one); `moe_quantize`:
    (bits, block_size) for the experts' weights (targets that `quantize`); `attends`: whether some layer
    attends (not in a pure state-space model)."""
    passes = target
    graph = model.graph
    canonical = canonical_nodes(graph)
    if not canonical and attends:
        raise ExportError("the exported graph has no kvforge attention node; attention was not routed through the op")
    if kv_scales is not None and not passes.kv_cache_dtypes:
        raise ExportError(f"the {passes.name} target has no quantised KV cache")
    if moe_quantize is not None and not passes.quantize:
        raise ExportError(f"the {passes.name} target has no quantised experts")
    if canonical:
        passes.lower_attention(graph, canonical, rotary, kv_scales)
    passes.lower_moe(graph, moe_quantize)
    graph.opset_imports.pop(DOMAIN, None)
    # The rotary and layout ops folded into attention are now unused (and the fusion's functions).
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.passes.common.RemoveUnusedFunctionsPass()(model)
    ir.passes.common.RemoveUnusedOpsetsPass()(model)
    return model
