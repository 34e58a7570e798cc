"""Graph clean-up after the trace: constant folding and the rewrites decoder graphs need, then the
fusions a target asks for (exporter/fusions.py)."""

from __future__ import annotations

from typing import Any

from kvforge.exporter.targets import ExportTarget


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

    from kvforge.exporter.lazy_weights import transpose_weights_lazily

    optimizer.inline(model)
    transpose_weights_lazily(model)  # before the folding, which would transpose every weight in memory
    cleanups = [
        rules.no_op_cast_rule, rules.no_op_expand_rule, rules.no_op_transpose_rule, rules.cast_cast_rule,
        *exact_no_op_rules(),
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


def exact_no_op_rules() -> list[Any]:
    """x + 0, x - 0, x * 1 and x / 1 -> x, for a scalar constant that is exactly 0 or 1.

    onnxscript's own rules match their constant with abs_tol 1e-8 and rel_tol 1e-5, so they also
    delete `variance + 1e-8` (Helium's RMSNorm eps): an all-zero row (a padding embedding) then
    normalises to inf * 0 = NaN."""
    from onnxscript.rewriter import pattern

    def exactly(expected: float):
        def check(context: Any, x: Any, c: Any, **_: Any) -> bool:
            value = c.const_value
            return value is not None and value.shape.rank() == 0 and float(value.numpy()) == expected
        return check

    def add(op: Any, x: Any, c: Any) -> Any:
        return op.Add(x, c)

    def sub(op: Any, x: Any, c: Any) -> Any:
        return op.Sub(x, c)

    def mul(op: Any, x: Any, c: Any) -> Any:
        return op.Mul(x, c)

    def div(op: Any, x: Any, c: Any) -> Any:
        return op.Div(x, c)

    def identity(op: Any, x: Any, **_: Any) -> Any:
        return op.Identity(x)

    return [pattern.RewriteRule(add, identity, exactly(0.0)), pattern.RewriteRule(sub, identity, exactly(0.0)),
            pattern.RewriteRule(mul, identity, exactly(1.0)), pattern.RewriteRule(div, identity, exactly(1.0))]


def fuse_graph(model: Any, target: ExportTarget, quantized: bool = False, dtype: str = "fp32",
               merge_pairs: bool | None = None) -> dict[str, int]:
    """The fusions of exporter/fusions.py that suit `target`: ONNX Runtime's normalization and rotary
    contrib ops where the target runs on ONNX Runtime's contrib ops; merged parallel MatMuls (q/k/v)
    for every target, and pairs (gate/up) too when the weights are about to be `quantized` or an `ort`
    export is fp16/bf16 (ONNX Runtime CUDA's dtypes: at batch 1 each MatMul is one ~3.5 us cuBLAS
    kernel on an H100, so one merged GEMM and a Split beat two GEMMs; benchmarks/README.md).
    `merge_pairs`: that choice forced either way (benchmarks compare the two)."""
    from kvforge.exporter.fusions import drop_reshape_round_trips, fuse_for_ort, fuse_parallel_matmuls

    counts = fuse_for_ort(model) if target.ort_fusions else {}
    counts["parallel_matmuls"] = fuse_parallel_matmuls(model)
    if merge_pairs is None:
        merge_pairs = quantized or dtype in target.merge_pairs_dtypes
    if merge_pairs:
        counts["paired_matmuls"] = fuse_parallel_matmuls(model, group_size=2)
    counts["reshape_round_trips"] = drop_reshape_round_trips(model)
    return counts
