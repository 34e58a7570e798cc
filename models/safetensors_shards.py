"""Safetensors shards written a tensor block at a time, as `save_pretrained` lays them out.

A shard's header is known from the tensors' shapes before any value exists, so each file is its header
and then every tensor's bytes streamed in order: writing a checkpoint holds one block of one tensor,
never a shard (safetensors' `save_file` takes the whole dict) nor the model. Used by the GGUF conversion
(models/gguf.py) and the real-shape checkpoints (benchmarks/make_real_shape.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

INDEX_NAME = "model.safetensors.index.json"


class Planned(Protocol):
    """What the writer needs of a tensor before its values exist."""

    name: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int


def plan_shards(plan: Sequence[Planned], shard_bytes: int) -> list[list[Planned]]:
    """Tensors in order, a new shard when the next one would take the current one past `shard_bytes`
    (as save_pretrained's max_shard_size does)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for tensor in plan:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shard(path: Path, tensors: Sequence[Planned], dtype_tag: str,
                blocks: Callable[[Any], Iterable[Any]], done: Callable[[Any], None]) -> None:
    """One safetensors file: the header (from the shapes), then each tensor's blocks (numpy arrays or torch
    tensors of `dtype_tag`'s type, e.g. "F32", in C order) in order."""
    import numpy as np

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": dtype_tag, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for tensor in tensors:
            written = 0
            for block in blocks(tensor):
                data = block.numpy() if hasattr(block, "numpy") and not isinstance(block, np.ndarray) else block
                data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                out.write(memoryview(data))
                written += data.nbytes
            if written != tensor.nbytes:
                raise RuntimeError(f"{tensor.name}: wrote {written} bytes, its shape needs {tensor.nbytes}")
            done(tensor)


def write_checkpoint(folder: Path, plan: Sequence[Planned], dtype_tag: str, blocks: Callable[[Any], Iterable[Any]],
                     shard_bytes: int, done: Callable[[Any], None] = lambda _tensor: None) -> list[str]:
    """Every tensor of `plan` into shards of at most `shard_bytes` (one tensor may exceed it) in `folder`,
    with the index when there is more than one shard; the shard files' names."""
    shards = plan_shards(plan, shard_bytes)
    files = shard_names(len(shards))
    for file, tensors in zip(files, shards, strict=True):
        write_shard(folder / file, tensors, dtype_tag, blocks, done)
    if len(shards) > 1:
        index = {"metadata": {"total_parameters": sum(t.numel for t in plan),
                              "total_size": sum(t.nbytes for t in plan)},
                 "weight_map": {t.name: file for file, tensors in zip(files, shards, strict=True) for t in tensors}}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
