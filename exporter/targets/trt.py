"""The `trt` target: kvforge's TensorRT plugin node per layer (kvforge.core.contract.PLUGIN: its op type,
plugin_namespace and plugin_version), implemented by the Triton kernel (plugins/trt_plugin.py), with the
canonical node's inputs, outputs and attributes; the export checks the model against the kernel's shapes."""

from __future__ import annotations

import onnx_ir as ir

from kvforge.core.contract import ATTENTION_OUTPUTS, PLUGIN, AttentionAttrs
from kvforge.core.errors import UnsupportedModelError
from kvforge.exporter.graph_edit import attention_inputs, node_attributes, replace_node
from kvforge.exporter.targets.base import ExportTarget, alibi_input


def lower_to_trt(graph: ir.Graph, canonical: list[ir.Node], rotary: object = None, kv_scales: object = None) -> None:
    """The plugin node per layer. TensorRT's ONNX parser ignores node domains and finds a plugin by op
    type plus the node attributes plugin_namespace / plugin_version; the node's domain is the one
    onnxruntime-extensions' Python ops use, so the CPU emulation (runtime/emulate.py) serves the very
    same node."""
    for node in canonical:
        if attention_inputs(node)[1] is not None:
            raise UnsupportedModelError("the model's attention has sinks, which kvforge's TensorRT kernel does not "
                                        "implement; use --target ort or --target onnx")
        if alibi_input(node) is not None:
            raise UnsupportedModelError("the model's attention uses ALiBi position biases, which kvforge's TensorRT "
                                        "kernel does not implement; use --target ort or --target onnx")
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
    from kvforge.exporter import moe  # torch's op registry: loaded when an export lowers, not before

    return moe.lower_moe_to_plain(graph, quantize)


TARGET = ExportTarget("trt", lower_to_trt, lower_moe, kernel_shapes=True)
