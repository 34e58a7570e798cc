"""The plan applied to a traced prefill graph, in one call from exporter/graphs.py: the weight matrices (RTN or
HQQ, or integers carried over: matmuls.py), the int8 KV cache's scales (kv_cache.py) and what the experts'
lowering does with their weights (experts.py). Returns what the lowering and the manifest need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Applied:
    """What applying the plan left for the lowering and the manifest (None where not asked for)."""

    record: dict[str, Any] | None = None  # the manifest's "quantization"
    kv_scales: Any = None  # per layer (key scales, value scales) for a quantised cache
    kv_record: dict[str, Any] | None = None  # the manifest's "kv_cache_quantization"
    experts: tuple[int, int] | None = None  # (bits, block size) the MoE lowering quantises the experts with


def apply_plan(plan: Any, prefill: Any, model: Any, work: Any, layout: Any,
               lap: Callable[[str], None]) -> tuple[Any, Applied]:
    """`plan`: the export's plan.QuantPlan (not imported: the plan calls this module). The prefill graph with its weights quantised as `plan` says, and what else the plan asks of the export:
    the KV cache's scales (calibrated on `model`, --kv-cache) and the experts' bits for the lowering."""
    applied, say = Applied(), work.say
    if plan.quantize is not None:
        prefill, applied.record = _quantize_weights(plan, prefill, work)
        lap("quantize")
    if work.options.kv_cache is not None:
        from kvforge.exporter.quantization.kv_cache import calibrate

        say(f"calibrating {work.options.kv_cache} KV cache scales on kvforge's shipped text (per kv head and channel)")
        applied.kv_scales, applied.kv_record = calibrate(model, work.config, work.family, layout, work.model_dir,
                                                         work.options.kv_cache)
        lap("kv_calibrate")
    if applied.record is not None:
        applied.experts = _experts(plan, prefill, applied.record, say)
    return prefill, applied


def _quantize_weights(plan: Any, prefill: Any, work: Any) -> tuple[Any, dict[str, Any]]:
    from kvforge.exporter.quantization import matmuls

    say, exact = work.say, work.int_weights
    say(_quantising_line(plan, exact))
    assert plan.quantize is not None
    prefill, record = matmuls.quantize_model(prefill, plan.quantize, plan.block_size, int(work.config.vocab_size),
                                             plan.accuracy_level, plan.lm_head_bits, plan.method, exact=exact, say=say)
    if "integer_weights" in record:
        carried = record["integer_weights"]
        say(f"{carried['carried_over']} weight matrices carried over from the {carried['source']}'s integers as "
            f"they are; {len(carried['rounded'])} rounded ({', '.join(carried['rounded'][:3]) or 'none'}"
            f"{', ...' if len(carried['rounded']) > 3 else ''})")
    return prefill, {**record, **plan.record()}


def _experts(plan: Any, prefill: Any, record: dict[str, Any], say: Callable[[str], None]) -> tuple[int, int] | None:
    """The experts' bits: ONNX Runtime's QMoE takes int4 blocks (quantised by the MoE lowering, in its own layout);
    int8 experts stay as they are (experts.py INT8_EXPERTS says why)."""
    from kvforge.core.contract import MOE_OP
    from kvforge.exporter.quantization.experts import INT8_EXPERTS

    experts = sum(1 for node in prefill.graph if node.domain == MOE_OP.domain and node.op_type == MOE_OP.op_type)
    if not experts:
        return None
    if plan.bits == 4:
        record["moe_experts"] = f"int4, blocks of {plan.block_size} (ONNX Runtime's QMoE), {experts} layers"
        say(f"quantising {experts} MoE layers' experts to int4 (ONNX Runtime's QMoE)")
        return 4, plan.block_size
    record["moe_experts"] = INT8_EXPERTS
    say(f"note: {INT8_EXPERTS}")
    return None


def _quantising_line(plan: Any, exact: Any) -> str:
    """What the quantisation step says: integers placed as they are (a pre-quantised checkpoint), or rounded."""
    if exact is not None and not exact.rounds_the_rest:  # a pre-quantised checkpoint: nothing is rounded
        return (f"placing the {exact.kind} checkpoint's {plan.quantize} integers into ONNX Runtime's MatMulNBits "
                f"(blocks of {plan.block_size}) as they are")
    why = plan.lm_head_why
    return (f"quantising the weights to {plan.quantize} (blocks of {plan.block_size}, "
            f"{plan.method.upper()}, ONNX Runtime's MatMulNBits)" + (f"; {why}" if why else "")
            + (f"; {plan.method_why}" if plan.method_why else ""))
