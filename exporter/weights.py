"""One external weights file shared by the prefill and decode graphs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx_ir as ir

# Smaller initializers (shapes, scalars) stay inline in each graph.
SIZE_THRESHOLD = 1024


# torch.onnx records each node's Python stack trace, which names FX's generated code by a per-process
# counter ("<eval_with_key>.92"): the same model exported in two processes would differ in bytes.
STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(model: ir.Model) -> None:
    """Remove the per-process stack-trace metadata from every node (subgraphs and functions too)."""
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            node.metadata_props.pop(STACK_TRACE_KEY, None)


def save_with_shared_weights(models: dict[str, ir.Model], folder: Path, weights_name: str) -> dict[str, int]:
    """Save `{phase: model}` as `folder/{phase}.onnx`, all large initializers in one file.

    Tensors are keyed by content: a weight both graphs hold (whatever the exporter named it) is
    written once and referenced by both. Returns bytes written vs. bytes separate files would take.
    """
    unique: dict[str, ir.TensorProtocol] = {}
    keys: dict[tuple[str, str], str] = {}
    total = 0
    for phase, model in models.items():
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < SIZE_THRESHOLD:
                continue
            total += tensor.nbytes
            key = f"{tensor.dtype}:{tuple(tensor.shape)}:{hashlib.sha256(tensor.tobytes()).hexdigest()}"
            unique.setdefault(key, tensor)
            keys[(phase, name)] = key
    order = list(unique)
    external = ir.external_data.convert_tensors_to_external(
        [unique[key] for key in order], base_dir=folder, relative_path=weights_name
    )
    by_key = dict(zip(order, external, strict=True))
    for phase, model in models.items():
        for name, value in model.graph.initializers.items():
            if (phase, name) in keys:
                value.const_value = by_key[keys[(phase, name)]]
        drop_stack_traces(model)
        ir.save(model, folder / f"{phase}.onnx")
    return {"weights_bytes": sum(t.nbytes for t in unique.values()), "unshared_bytes": total}
