"""A lazy, validated view of a Hugging Face folder's safetensors weights.

An exporter streams the weights tensor by tensor: `open_checkpoint` reads only the safetensors headers
(8-byte little-endian length, then the JSON header: dtype, shape, data_offsets per tensor) and refuses a
folder that would fail part-way (a missing or truncated shard, an index that disagrees with its shards,
a tensor stored twice, weight matrices of mixed dtypes) before any tensor data is read. `read` then maps
one tensor at a time.

Memory: a safetensors handle maps its whole file, and every page of it a read touched counts in the
process's RSS for as long as that mapping lives. So `read` opens the file, takes the one tensor and
drops the handle (about 0.15 ms a read): the tensor's storage keeps the mapping alive exactly as long as
the caller holds the tensor, and the peak RSS of a streaming export is bounded by the tensors it holds,
not by the shard (a handle kept open per file grows the RSS to the whole shard as it is read).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kvforge.core.errors import InputError

INDEX_FILE = "model.safetensors.index.json"
# safetensors' own limit on the JSON header; a larger length is a corrupted file, not a big model.
MAX_HEADER_BYTES = 100_000_000
# Bits per element of each safetensors dtype (F4/F6 pack several elements per byte).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# The dtypes an export computes in, by their torch names. Float8/4/6 are quantised storage and integers
# are packed weights or indices: neither takes part in the one-dtype check.
COMPUTE_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its safetensors dtype ('F16', 'BF16', ...), shape, file, size in bytes and
    the absolute byte offset of its data in that file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    nbytes: int
    offset: int


class Checkpoint:
    """The tensors of a checkpoint, validated by open_checkpoint; data is read on demand by `read`."""

    def __init__(self, model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
        self.model_dir = model_dir
        self._tensors = tensors
        self.names: list[str] = sorted(tensors)
        self.files: list[Path] = sorted({info.file for info in tensors.values()})
        self.nbytes: int = sum(info.nbytes for info in tensors.values())
        self.largest_nbytes: int = max((info.nbytes for info in tensors.values()), default=0)
        matrices = [info.dtype for info in tensors.values() if _is_compute_matrix(info)]
        # The dtype of the weight matrices (checked to be one); None when every matrix is quantised.
        self.dtype: str | None = COMPUTE_DTYPES[matrices[0]] if matrices else None

    def info(self, name: str) -> TensorInfo:
        """The TensorInfo of `name`; KeyError naming it when the checkpoint has no such tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of the checkpoint in {self.model_dir}") from None

    def read(self, name: str) -> Any:
        """The tensor `name` as a torch.Tensor memory-mapped from its file (pages are read when touched).
        Writing into it changes this copy only (a private mapping), never the file."""
        from safetensors import safe_open

        info = self.info(name)
        # One handle per read (see the module's note): the tensor alone keeps the file mapped.
        with safe_open(str(info.file), framework="pt") as handle:
            return handle.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.model_dir)!r}, {len(self)} tensors in {len(self.files)} files, "
                f"{self.nbytes / 1e9:.2f} GB, dtype={self.dtype})")


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """The safetensors weights of a Hugging Face folder, validated from their headers alone: its
    model.safetensors.index.json (when present) names the shards, else every *.safetensors in the folder is
    one. Raises InputError, naming the file and what to do, for anything that would fail while streaming."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"{model_dir} is not a folder; pass a Hugging Face model folder")
    index_file = model_dir / INDEX_FILE
    weight_map = _read_index(index_file) if index_file.is_file() else None
    if weight_map is not None:
        shard_names = sorted(set(weight_map.values()))
        files = [_shard_path(model_dir, index_file, shard) for shard in shard_names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise InputError(f"{model_dir} has no weights (*.safetensors nor {INDEX_FILE}); pass a complete "
                             "Hugging Face model folder")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in _read_header(file).items():
            if name in tensors:
                raise InputError(
                    f"{name} is stored twice, in {tensors[name].file} and in {file}; a checkpoint holds each tensor "
                    "once: remove the stale shard (or download the folder again)")
            tensors[name] = info
    if weight_map is not None:
        for name, shard in sorted(weight_map.items()):
            info = tensors.get(name)
            if info is None or info.file.name != PurePosixPath(shard).name:
                where = "no shard" if info is None else f"{info.file}"
                raise InputError(
                    f"{index_file} maps {name} to {model_dir / shard}, which does not hold it (it is in {where}); "
                    "the index and the shards come from different saves: download or save the folder again")
    _check_one_dtype(model_dir, tensors)
    return Checkpoint(model_dir, tensors)


def _read_index(index_file: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name)."""
    try:
        index = json.loads(index_file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{index_file} is not valid JSON ({err}); download or save the folder again") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise InputError(f"{index_file} has no weight_map of tensor names to shard files; download or save the "
                         "folder again")
    if not weight_map:
        raise InputError(f"{index_file} maps no tensors; download or save the folder again")
    return weight_map


def _shard_path(model_dir: Path, index_file: Path, shard: str) -> Path:
    """The shard file an index names: a file of the model folder itself, and present."""
    relative = PurePosixPath(shard)
    if relative.is_absolute() or ".." in relative.parts:
        raise InputError(f"{index_file} names the shard {shard!r} outside the model folder; an index names files "
                         "of its own folder: fix the index or save the folder again")
    path = model_dir / relative
    if not path.is_file():
        raise InputError(f"{index_file} names the shard {path}, which does not exist; the download or copy is "
                         "incomplete: fetch the missing shard (or the whole folder) again")
    return path


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header; the file must be long enough for all of them."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _truncated(file, size, 8)
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise _invalid(file, f"its header length reads {header_len} bytes")
            if 8 + header_len > size:
                raise _truncated(file, size, 8 + header_len)
            raw = handle.read(header_len)
    except OSError as err:
        raise InputError(f"cannot read {file}: {err.strerror or err}; check the file's permissions") from err
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as err:
        raise _invalid(file, f"its header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise _invalid(file, f"its header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(file, name, entry, data_start)
    end = max((info.offset + info.nbytes for info in tensors.values()), default=data_start)
    if end > size:
        raise _truncated(file, size, end)
    return tensors


def _tensor_info(file: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape of non-negative ints, offsets that span its bytes."""
    if not isinstance(entry, dict):
        raise _invalid(file, f"its header entry for {name} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _invalid(file, f"{name} has the unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise _invalid(file, f"{name} has the shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise _invalid(file, f"{name} has the data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    nbytes = -(-math.prod(shape) * DTYPE_BITS[dtype] // 8)
    if offsets[1] - offsets[0] != nbytes:
        raise _invalid(file, f"{name} is {dtype} {shape} ({nbytes} bytes) but its data_offsets span "
                             f"{offsets[1] - offsets[0]} bytes")
    return TensorInfo(name, dtype, tuple(shape), file, nbytes, data_start + offsets[0])


def _truncated(file: Path, size: int, needed: int) -> InputError:
    return InputError(f"{file} is truncated: it has {size} bytes but its header needs {needed}; the download or "
                      "copy did not finish: fetch the file again")


def _invalid(file: Path, why: str) -> InputError:
    return InputError(f"{file} is not a valid safetensors file: {why}; fetch or save the file again")


def _is_compute_matrix(info: TensorInfo) -> bool:
    # Quantisation scales are float matrices kept in their own dtype beside the weights (FP8 and
    # compressed-tensors checkpoints keep float32 block scales next to bfloat16 embeddings): not weights.
    leaf = info.name.rsplit(".", 1)[-1]
    return info.dtype in COMPUTE_DTYPES and len(info.shape) >= 2 and "scale" not in leaf


def _check_one_dtype(model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
    """The weight matrices share one float dtype (1-D tensors such as norms may differ: checkpoints keep
    them in float32 beside half-precision matrices), since an export casts nothing but those 1-D tensors."""
    first: dict[str, TensorInfo] = {}
    for name in sorted(tensors):
        info = tensors[name]
        if _is_compute_matrix(info):
            first.setdefault(info.dtype, info)
    if len(first) > 1:
        examples = ", ".join(f"{info.name} is {dtype} (in {info.file.name})" for dtype, info in first.items())
        raise InputError(
            f"the weight matrices of {model_dir} mix dtypes: {examples}; kvforge streams one weights dtype: "
            "re-save the checkpoint in one dtype (e.g. load it in transformers with dtype=... and save_pretrained)")
