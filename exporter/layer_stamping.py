"""Tracing time that does not grow with depth: a model whose decoder layers are all alike is traced with
two of them, and the second layer's part of the graph is stamped for the rest.

torch.onnx's dynamo trace costs about two seconds per Llama layer here (torch.export, then its
decompositions), 75 s of an 8B export. Every layer of such a model traces to the same nodes; only its
weights' names and its KV inputs and outputs differ. So the trace sees layers 0 and 1, and layers 2..N-1
are copies of layer 1's nodes (found by the module scope torch.onnx records on each node), reading
their own weights (`model.layers.{k}.*`: lazy checkpoint reads like every other weight) and their own
`past_*.{k}` / `present_*.{k}`. Layer 1 is the template rather than 0, so that what flows from one layer
into the next is seen (layer 0's output read by layer 1) and checked to be the hidden state alone.

Only where it cannot differ: a streamed export (weights are attached by name afterwards), a family
whose layers have no per-layer pattern, a uniform KV layout without recurrent state, layers of one
class with the same parameters, and a graph whose layer 1 reads nothing of layer 0 but its output.
Anything else traces every layer, as before (`StampRefused` says why).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import onnx_ir as ir

from kvforge.core.contract import IMAGE_FEATURES, POSITION_IDS, GraphIO, KVLayout
from kvforge.models.families import Family

SCOPES = "pkg.torch.onnx.name_scopes"
TRACED_LAYERS = 2
_MIN_LAYERS = 4  # below this, stamping saves nothing worth the second code path


class StampRefused(Exception):
    """Why a graph was not stamped (the export then traces every layer)."""


@dataclasses.dataclass
class StampPlan:
    """Where the decoder layers are and how many: the module path as torch.onnx scopes name it."""

    container: Any  # the nn.ModuleList of decoder layers
    scope: str  # e.g. "model.model.layers": layer k's nodes carry the scope f"{scope}.{k}"
    total: int


def stamp_plan(model: Any, config: Any, layout: KVLayout, family: Family) -> StampPlan | str:
    """The plan for a model whose layers can be stamped (its family says they are alike), or why not."""
    import torch

    total = layout.num_layers
    if not family.uniform_layers:
        return f"{family.model_type} is not among the families whose layers are alike"
    if layout.layers or layout.states or total < _MIN_LAYERS:
        return "its KV layout differs per layer" if layout.layers or layout.states else f"only {total} layers"
    kinds = set(getattr(config, "layer_types", None) or [])
    if len(kinds) > 1:
        return f"its layers are of kinds {sorted(kinds)}"
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == total]
    if len(found) != 1:
        return f"{len(found)} module lists of {total} layers"
    name, container = found[0]
    template = _parameter_shapes(container[1])
    for layer in container:
        if type(layer) is not type(container[1]) or _parameter_shapes(layer) != template:
            return "its layers differ in class or parameters"
    return StampPlan(container, f"model.{name}", total)  # GraphWrapper holds the model as `model`


def _parameter_shapes(module: Any) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters(remove_duplicate=False)]


@contextlib.contextmanager
def traced_prefix(model: Any, plan: StampPlan, layout: KVLayout) -> Iterator[KVLayout]:
    """The model with its first TRACED_LAYERS layers only (and the layout for them), restored after."""
    import torch

    parents = [module for module in model.modules() if any(child is plan.container for child in module.children())]
    names = [name for name, child in parents[0].named_children() if child is plan.container]
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_hidden_layers")}
    setattr(parents[0], names[0], torch.nn.ModuleList(list(plan.container)[:TRACED_LAYERS]))
    for config in configs.values():
        config.num_hidden_layers = TRACED_LAYERS
    try:
        yield dataclasses.replace(layout, num_layers=TRACED_LAYERS)
    finally:
        setattr(parents[0], names[0], plan.container)
        for config in configs.values():
            config.num_hidden_layers = plan.total


def _layer(node: ir.Node, scope: str) -> int | None:
    """Which decoder layer a traced node belongs to, by its module scopes (None: outside the layers)."""
    text = node.metadata_props.get(SCOPES)
    if not text:
        return None
    prefix = scope + "."
    for entry in ast.literal_eval(text):
        if entry.startswith(prefix) and entry[len(prefix):].isdigit():
            return int(entry[len(prefix):])
    return None


def stamp_layers(model: ir.Model, plan: StampPlan, layout: KVLayout) -> int:
    """Extend a graph traced with TRACED_LAYERS layers to plan.total, copying layer 1's nodes; returns how
    many layers were stamped. Raises StampRefused (the graph untouched) where layer 1 is not a template."""
    graph = model.graph
    by_layer: dict[int, list[ir.Node]] = {}
    for node in graph:
        by_layer.setdefault(_layer(node, plan.scope), []).append(node)
    first, template = by_layer.get(0, []), by_layer.get(1, [])
    if not first or not template or set(by_layer) - {None, 0, 1}:
        raise StampRefused(f"the traced layers are {sorted(k for k in by_layer if k is not None)}, not [0, 1]")
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
           for node in template for attr in node.attributes.values()):
        raise StampRefused("layer 1 holds a subgraph")
    in_template = set(template)
    link_in = _crossing(first, in_template, inside=True)
    link_out = _crossing(template, in_template, inside=False)
    if len(link_in) != 1 or len(link_out) != 1:
        raise StampRefused(f"{len(link_in)} values flow from layer 0 into layer 1 and {len(link_out)} out of "
                           "layer 1, not the hidden state alone")
    per_layer_inputs = _per_layer_inputs(graph, template, plan.scope)
    outside_uses = [(node, index) for node, index in link_out[0].uses() if node not in in_template]
    previous, anchor = link_out[0], template[-1]
    for k in range(TRACED_LAYERS, plan.total):
        nodes, previous = _copy_layer(graph, template, k, (link_in[0], link_out[0], previous), per_layer_inputs,
                                      plan.scope)
        graph.insert_after(anchor, nodes)
        anchor = nodes[-1]
    for node, index in outside_uses:
        node.replace_input_with(index, previous)
    _order_io(graph, layout)
    return plan.total - TRACED_LAYERS


def _crossing(nodes: list[ir.Node], template: set[ir.Node], inside: bool) -> list[ir.Value]:
    """Values of `nodes` read by the template (inside) / read outside the template, graph outputs aside.
    Constants are not crossings: torch.onnx makes each constant once and every layer reads it."""
    found = []
    for node in nodes:
        if node.op_type == "Constant" and node.domain == "":
            continue
        for value in node.outputs:
            users = {user for user, _ in value.uses()}
            if (inside and users & template) or (not inside and users - template):
                found.append(value)
    return found


def _per_layer_inputs(graph: ir.Graph, template: list[ir.Node], scope: str) -> dict[ir.Value, str]:
    """Graph inputs and initializers layer 1 reads as its own, each with its name for layer {k} ('{k}')."""
    own: dict[ir.Value, str] = {}
    inputs = {value.name for value in graph.inputs}
    weights_1, weights_0 = f"{scope}.1.", f"{scope}.0."  # initializers are named by module path, as scopes
    for node in template:
        for value in node.inputs:
            if value is None or value in own:
                continue
            name = value.name or ""
            if value.is_graph_input() and name.endswith(".1") and name[:-1] + "0" in inputs:
                own[value] = name[:-1] + "{k}"
            elif value.is_initializer() and name.startswith(weights_0):
                raise StampRefused(f"layer 1 reads layer 0's weight {name}")
            elif value.is_initializer() and name.startswith(weights_1):
                own[value] = f"{scope}.{{k}}." + name[len(weights_1):]
    return own


def _copy_layer(graph: ir.Graph, template: list[ir.Node], k: int, links: tuple[ir.Value, ir.Value, ir.Value],
                own: dict[ir.Value, str], scope: str) -> tuple[list[ir.Node], ir.Value]:
    """Layer k: the template's nodes reading layer k-1's output (`links`: the template's input and output,
    layer k-1's output), layer k's inputs and weights; the nodes and layer k's output."""
    link_in, link_out, previous = links
    mapping: dict[ir.Value, ir.Value] = {link_in: previous}
    for value, pattern in own.items():
        name = pattern.replace("{k}", str(k))
        copy = ir.Value(name=name, shape=value.shape, type=value.type, const_value=value.const_value)
        if value.is_graph_input():
            graph.inputs.append(copy)
        else:
            graph.register_initializer(copy)
        mapping[value] = copy
    outputs = {value.name: i for i, value in enumerate(graph.outputs)}
    nodes = []
    for node in template:
        copy = ir.Node(node.domain, node.op_type, [mapping.get(v, v) if v is not None else None for v in node.inputs],
                       attributes=list(node.attributes.values()), overload=node.overload,
                       num_outputs=len(node.outputs), version=node.version, name=f"{node.name}.l{k}",
                       metadata_props={SCOPES: node.metadata_props.get(SCOPES, "").replace(f"{scope}.1", f"{scope}.{k}")})
        for old, new in zip(node.outputs, copy.outputs, strict=True):
            new.name = f"{old.name}.l{k}" if old.name not in outputs else old.name[:-1] + str(k)
            new.shape, new.type = old.shape, old.type
            mapping[old] = new
            if old.name in outputs:
                graph.outputs.append(new)
        nodes.append(copy)
    return nodes, mapping[link_out]


def _order_io(graph: ir.Graph, layout: KVLayout) -> None:
    """Inputs and outputs in the contract's order for the whole layout (a vision-language prefill's image features
    and multimodal positions, where the trace took them, among them)."""
    inputs = {value.name: value for value in graph.inputs}
    io = GraphIO.of("prefill", layout, images=IMAGE_FEATURES in inputs, mrope=POSITION_IDS in inputs)
    outputs = {value.name: value for value in graph.outputs}
    if set(inputs) != set(io.inputs) or set(outputs) != set(io.outputs):
        raise RuntimeError(f"stamped graph IO {sorted(set(inputs) ^ set(io.inputs))} "
                           f"{sorted(set(outputs) ^ set(io.outputs))} differ from the contract's")
    graph.inputs[:] = [inputs[name] for name in io.inputs]
    graph.outputs[:] = [outputs[name] for name in io.outputs]
