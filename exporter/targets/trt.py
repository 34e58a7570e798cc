"""The `trt` target: kvforge's TensorRT plugin node per layer (kvforge.core.contract.PLUGIN: its op type,
plugin_namespace and plugin_version), implemented by the Triton kernel (plugins/trt_plugin.py), with the
canonical node's inputs, outputs and attributes. The target owns its refusals: the kernel's head shapes and
dtypes, recurrent states (the engines carry no state), sinks and ALiBi (the kernel has neither), and the coverage
sweep's recorded `trt` failure of a type."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from kvforge.core.contract import ATTENTION_OUTPUTS, PLUGIN, AttentionAttrs, KVLayout
from kvforge.core.errors import UnsupportedModelError
from kvforge.core.targets import TARGETS
from kvforge.exporter.graph_edit import attention_inputs, node_attributes, replace_node
from kvforge.exporter.image_blocks import block_ids_input
from kvforge.exporter.targets.base import ExportTarget, alibi_input, bias_input
from kvforge.models.config_values import config_value

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two the Triton kernel compiles for


def lower_to_trt(graph: ir.Graph, canonical: list[ir.Node], rotary: object = None, kv_scales: object = None) -> None:
    """The plugin node per layer. TensorRT's ONNX parser ignores node domains and finds a plugin by op
    type plus the node attributes plugin_namespace / plugin_version; the node's domain is the one
    onnxruntime-extensions' Python ops use, so the CPU emulation (runtime/backends/emulate.py) serves the very
    same node."""
    for node in canonical:
        if attention_inputs(node)[1] is not None:
            raise UnsupportedModelError("the model's attention has sinks, which kvforge's TensorRT kernel does not "
                                        "implement; use --target ort or --target onnx")
        if alibi_input(node) is not None:
            raise UnsupportedModelError("the model's attention uses ALiBi position biases, which kvforge's TensorRT "
                                        "kernel does not implement; use --target ort or --target onnx")
        if bias_input(node) is not None:
            raise UnsupportedModelError("the model's attention adds a position bias (T5's), which kvforge's TensorRT "
                                        "kernel does not implement; use --target ort or --target onnx")
        if block_ids_input(node) is not None:
            raise UnsupportedModelError("the model's image tokens attend both ways, which kvforge's TensorRT kernel "
                                        "does not implement; use --target ort or --target onnx")
        attrs = AttentionAttrs.from_mapping(node_attributes(node))
        tape = ir.tape.Tape()
        outputs = tape.op_multi_out(
            PLUGIN.name,
            list(node.inputs),
            attributes={**PLUGIN.node_attributes(), **attrs.as_dict()},
            domain=PLUGIN.onnx_domain,
            num_outputs=len(ATTENTION_OUTPUTS),
        )
        replace_node(graph, node, tape, list(outputs))
    graph.opset_imports[PLUGIN.onnx_domain] = 1



def lower_moe(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    # Imported when an export lowers, not with the target registry (it brings in exporter/quantization).
    from kvforge.exporter.targets import moe_plain

    return moe_plain.lower_moe_to_plain(graph, quantize)


def check_kernel_shapes(target: ExportTarget, config: Any, family: Any, head_dim: int, dtype: str,
                        kv_heads: int | None = None) -> None:
    """kvforge's own kernel: refuse at export the head shapes and dtypes it cannot compute."""
    from kvforge.plugins import attention_launch

    kv_heads = kv_heads or family.kv_heads(config)
    heads = config_value(config, "num_attention_heads")
    if heads is None:  # no attention (a state-space model): nothing for the kernel; its states are refused later
        return
    try:
        attention_launch.check_shapes(heads, kv_heads, head_dim)
    except ValueError as err:
        raise UnsupportedModelError(
            f"--target {target.name} cannot export {config.model_type} ({err}): kvforge's attention kernel supports "
            f"head_dim {', '.join(map(str, HEAD_DIMS))}, query heads a multiple of the KV heads, and "
            f"dtype {', '.join(target.core.dtypes)}; use {target.others(lambda _t: True)} for this model"
        ) from err
    if dtype not in target.core.dtypes:
        raise UnsupportedModelError(f"--target {target.name} supports dtype {', '.join(target.core.dtypes)}, not "
                                    f"{dtype!r}")


def _refuse_model(target: ExportTarget, config: Any, family: Any, dtype: str) -> None:
    if family.trt_refusal:
        raise UnsupportedModelError(f"--target {target.name} cannot export {config.model_type} (the coverage sweep: "
                                    f"{family.trt_refusal}); use --target ort or --target onnx")
    check_kernel_shapes(target, config, family, family.head_dim(config), dtype)


def _refuse_probed(target: ExportTarget, config: Any, family: Any, dtype: str, layout: KVLayout, sinks: bool) -> None:
    if layout.states:
        stateful = sorted({spec.layer for spec in layout.states})
        raise UnsupportedModelError(f"{config.model_type}: its layers {stateful[:8]} keep a recurrent state, which "
                                    f"--target {target.name}'s TensorRT engines do not carry yet; use --target ort or "
                                    "--target onnx")
    if sinks:
        # Worded as a reason (the sweep records it as the type's `trt` refusal, which the check before
        # loading raises; this one catches a model outside the registry's rows).
        raise UnsupportedModelError(f"{config.model_type}: its attention has sinks, which kvforge's TensorRT "
                                    f"kernel (--target {target.name}) does not implement")
    for heads, head_dim in sorted(set(layout.layer_shapes())):
        check_kernel_shapes(target, config, family, head_dim, dtype, kv_heads=heads)


TARGET = ExportTarget(TARGETS["trt"], lower_to_trt, lower_moe, refuse_model=_refuse_model,
                      refuse_probed=_refuse_probed, images=False, drafts=False)
