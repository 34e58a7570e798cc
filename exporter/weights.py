"""One external weights file shared by the prefill and decode graphs."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

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


# Tensors up to this size are also shared by content (the lowering's per-graph copies of the same table);
# larger ones only by identity, which is how the two graphs hold their weights (the decode graph is a clone
# of the prefill graph that shares its tensors): hashing every byte of an 8B model would read it twice.
HASHED_BYTES = 64 << 20


def _sharing_key(tensor: ir.TensorProtocol) -> str:
    if tensor.nbytes <= HASHED_BYTES and not isinstance(tensor, ir.LazyTensor):
        return f"{tensor.dtype}:{tuple(tensor.shape)}:{hashlib.sha256(tensor.tobytes()).hexdigest()}"
    raw = getattr(tensor, "raw", None)
    if hasattr(raw, "data_ptr") and hasattr(raw, "stride"):
        # A model parameter that separately traced graphs (an encoder-decoder's encoder and decoder) each wrap: the
        # same memory, the same tensor.
        return f"torch:{raw.data_ptr()}:{tuple(raw.stride())}:{tensor.dtype}:{tuple(tensor.shape)}"
    return f"id:{id(tensor)}"


def save_with_shared_weights(models: dict[str, ir.Model], folder: Path, weights_name: str,
                             progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Save `{phase: model}` as `folder/{phase}.onnx`, all large initializers in one file, written
    tensor by tensor (a lazy tensor is read, written and dropped: exporter/lazy_weights.py).

    A tensor both graphs hold is written once and referenced by both. Returns bytes written vs. bytes
    separate files would take. `progress(bytes written, bytes in all)` is called after each tensor.
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
            key = _sharing_key(tensor)
            unique.setdefault(key, tensor)
            keys[(phase, name)] = key
    order = list(unique)
    external, digest = _write_weights([unique[key] for key in order], folder, weights_name, progress)
    by_key = dict(zip(order, external, strict=True))
    for phase, model in models.items():
        for name, value in model.graph.initializers.items():
            if (phase, name) in keys:
                value.const_value = by_key[keys[(phase, name)]]
        drop_stack_traces(model)
        ir.save(model, folder / f"{phase}.onnx")
    return {"weights_bytes": sum(t.nbytes for t in external), "unshared_bytes": total, "weights_sha256": digest}


class _Hashing:
    """A write-only file that hashes what passes through it. It has no fileno(), so every tensor writes
    through write() (numpy's tofile would go around it)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.digest, self.written = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.written += len(view)
        return self.file.write(view)


def _write_weights(tensors: list[ir.TensorProtocol], folder: Path, name: str,
                   progress: Callable[[int, int], None] | None) -> tuple[list[ir.ExternalTensor], str]:
    """Write `tensors` one after another into folder/name (each lazy one read, written and dropped), hashing
    the file in the same pass (the manifest's sha256: the weights are not read back); their external tensors."""
    in_all, external = sum(t.nbytes for t in tensors), []
    with open(folder / name, "wb") as raw:
        out = _Hashing(raw)
        for tensor in tensors:
            offset = out.written
            tensor.tofile(out)
            if out.written - offset != tensor.nbytes:
                raise RuntimeError(f"tensor {tensor.name} wrote {out.written - offset} bytes, not {tensor.nbytes}")
            external.append(ir.ExternalTensor(name, offset, tensor.nbytes, tensor.dtype, shape=ir.Shape(tensor.shape),
                                              name=tensor.name or f"weight_{len(external)}", base_dir=folder))
            if progress is not None:
                progress(out.written, in_all)
    return external, out.digest.hexdigest()
