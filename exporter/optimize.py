"""Graph clean-up after the trace: constant folding and the rewrites decoder graphs need, then the
fusions a target asks for (exporter/fusions.py)."""

from __future__ import annotations

from typing import Any

from kvforge.targets import Target


def optimize_graph(model: Any) -> None:
    """Constant folding and the clean-up rewrites that decoder graphs need, in place.

    torch.onnx's `optimize=True` runs onnxscript's whole default optimizer twice over, which took
    16-19 s of a 45 s SmolLM2-135M trace; most of it is rules that never match a decoder (the
    slice-to-split rule alone is 3.7 s). This keeps only the rules that fire on the families we
    export (or that tidy what they leave) and gives the same graph (same ops, same counts) in
    about 3.5 s."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.rules import common as rules

    optimizer.inline(model)
    cleanups = [
        rules.no_op_cast_rule, rules.no_op_expand_rule, rules.no_op_transpose_rule, rules.cast_cast_rule,
        rules.add_0_rule, rules.sub_0_rule, rules.mul_by_1_rule, rules.div_by_1_rule,
        rules.dropout_inference_rule, rules.dropout_zero_rule,
        rules.collapse_slice_rule, rules.collapse_slice2_rule, rules.reshape_reshape_rule,
        rules.squeeze_reshape_1d_rule, rules.transpose_transpose_rule, rules.unsqueeze_unsqueeze_rule,
        rules.materialize_reshape_shape_rule, rules.cast_constant_of_shape_rule,
        rules.cast_constant_of_shape_without_value_rule, rules.one_reshape_matmul_reshape_rule,
        rules.two_reshapes_matmul_reshape_rule, *rules.expand_before_binary_op_rules,
    ]
    for _ in range(2):  # the second round catches what folding the first one's output exposes
        optimizer.fold_constants(model, onnx_shape_inference=True)
        passes.RemoveUnusedNodesPass()(model)
        rewriter.rewrite(model, pattern_rewrite_rules=cleanups)
    optimizer.fold_constants(model, onnx_shape_inference=True)
    ir.passes.Sequential(
        passes.RemoveUnusedNodesPass(),
        passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        passes.DeduplicateInitializersPass(),
        passes.CommonSubexpressionEliminationPass(),  # the per-layer shape arithmetic is the same
        passes.RemoveUnusedNodesPass(),
        passes.OutputFixPass(),
        passes.NameFixPass(),
    )(model)


def fuse_graph(model: Any, target: Target) -> dict[str, int]:
    """The fusions of exporter/fusions.py that suit `target`: ONNX Runtime's normalization and rotary
    contrib ops where the target runs on ONNX Runtime's contrib ops; merged parallel MatMuls for every
    target."""
    from kvforge.exporter.fusions import drop_reshape_round_trips, fuse_for_ort, fuse_parallel_matmuls

    counts = fuse_for_ort(model) if target.ort_fusions else {}
    counts["parallel_matmuls"] = fuse_parallel_matmuls(model)
    counts["reshape_round_trips"] = drop_reshape_round_trips(model)
    return counts
