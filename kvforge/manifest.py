"""The export folder's manifest, `kvforge.json`: written by the exporter, checked by every loader.

Kept free of torch/onnx so the runtime can read it. Shapes and names the runtime needs come
from here, never from model code.

Layout of the file (format "kvforge/2"; /1 had logits_index [B] and prefill logits [B, V]):

    {
      "format": "kvforge/2",
      "kvforge_version": "0.1.0",
      "kvforge_source": "fe8adf7b45d7cd39",   # digest of the exporter code (a cached export is reused only if equal)
      "created": "2026-11-22T02:30:00Z",
      "model": {"source": "/abs/path", "architecture": "LlamaForCausalLM", "model_type": "llama",
                "vocab_size": 512, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                "head_dim": 16, "hidden_size": 64, "max_position_embeddings": 2048,
                "bos_token_id": 1, "eos_token_id": [2], "pad_token_id": 0},
      "target": "ort",                  # lowering of the fused attention node: "ort" | "onnx"
      "dtype": "fp32",                  # weights/activations/KV dtype: "fp32" | "fp16"
      "kv_cache": {"layout": "BNSH", "dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
                   "head_dim": 16, "max_capacity": 2048},
      "graphs": {
        "prefill": {"file": "prefill.onnx",
                    "inputs":  [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}, ...],
                    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 512]}, ...]},
        "decode":  {...}
      },
      "weights": "model.weights",       # one external data file shared by both graphs
      "files": {"prefill.onnx": {"sha256": "...", "bytes": 123}, ...},
      "generation": {...},              # generation_config.json's sampling defaults, if any
      "tools": {"torch": "2.13.0", "transformers": "...", "onnx": "...", "onnxscript": "..."}
    }

Graph IO contract (DESIGN.md, KV cache): `input_ids [B,S] int64`, `past_lens [B] int32`,
prefill only `logits_index [B, K] int64` (which K positions of S to return logits for: 1 for a
plain prefill, more to verify speculative drafts), prefill logits `[B, K, V]`, decode logits `[B, V]`,
`past_key.{i}` / `past_value.{i}` `[B, H_kv, C, D]`; outputs `logits` and
`present_key.{i}` / `present_value.{i}` (same shape, bound to the same buffers as the past).

What a load checks (see README, "Safety and guarantees"): the structure above; that every file
the manifest names is a plain name inside the folder (no absolute paths, no `..`, no symlink out
of it) and is listed in `files`; every listed file's size; the sha256 of every file under
SMALL_FILE_BYTES (the graphs, tokenizer, configs); and with `verify_hashes` the sha256 of every
file, weights included. The graph bytes the runtime hands to ONNX Runtime are the bytes it hashed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from kvforge.errors import ManifestError

FORMAT = "kvforge/2"
MANIFEST_NAME = "kvforge.json"
PHASES = ("prefill", "decode")
# Files smaller than this are always hashed on load (cheap); larger ones (weights) with verify.
SMALL_FILE_BYTES = 64 << 20
_REQUIRED = {
    "model": ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"),
    "kv_cache": ("dtype", "num_layers", "num_kv_heads", "head_dim", "max_capacity"),
}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    path = Path(folder) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def is_export_folder(folder: str | Path) -> bool:
    """True if `folder` holds a kvforge.json that names a kvforge format (content not checked)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("kvforge/")


def resolve_in_folder(folder: Path, name: Any, what: str, kind: str = "export folder") -> Path:
    """`folder / name` for a plain relative file name of the manifest, or ManifestError if the name
    would leave the folder (absolute, `..`, or a symlink pointing outside)."""
    if not isinstance(name, str) or name == "":
        raise ManifestError(f"{folder / MANIFEST_NAME} names {what} {name!r}, which is not a file name; re-run the export")
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or name.startswith(("/", "\\")) or ":" in name:
        raise ManifestError(
            f"{folder} lists {what} {name!r} outside the {kind}; refusing to open it "
            "(the manifest was crafted or corrupted): re-run the export"
        )
    path = folder / pure
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ManifestError(
            f"{path} is a link that leads outside the {kind}; refusing to open it: re-run the export"
        )
    return path


def _validate(manifest: Any, path: Path) -> None:
    """Structure checks with messages that name the entry, so a bad file never ends in a KeyError."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} holds a JSON {type(manifest).__name__}, not an object; re-run the export")
    if manifest.get("format") != FORMAT:
        raise ManifestError(
            f"{path} has format {manifest.get('format')!r}, this kvforge reads {FORMAT!r}; re-export with this version"
        )
    for key in ("model", "target", "dtype", "kv_cache", "graphs", "files"):
        if key not in manifest:
            raise ManifestError(f"{path} lacks the {key!r} entry; re-run the export")
    for section, keys in _REQUIRED.items():
        if not isinstance(manifest[section], dict):
            raise ManifestError(f"{path}: {section!r} must be an object; re-run the export")
        for key in keys:
            value = manifest[section].get(key)
            if key == "dtype":
                if not isinstance(value, str):
                    raise ManifestError(f"{path}: {section}.{key} must be a string, got {value!r}; re-run the export")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ManifestError(f"{path}: {section}.{key} must be a positive integer, got {value!r}; re-run the export")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ManifestError(f"{path}: 'files' must be an object of file records; re-run the export")
    for name, record in files.items():
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("sha256"), str)
            or isinstance(record.get("bytes"), bool)
            or not isinstance(record.get("bytes"), int)
        ):
            raise ManifestError(f"{path}: files[{name!r}] must hold 'sha256' and 'bytes'; re-run the export")
    graphs = manifest["graphs"]
    if not isinstance(graphs, dict):
        raise ManifestError(f"{path}: 'graphs' must be an object; re-run the export")
    for phase in PHASES:
        graph = graphs.get(phase)
        if not isinstance(graph, dict):
            raise ManifestError(f"{path} lists no {phase!r} graph; re-run the export")
        if graph.get("file") not in files:
            raise ManifestError(
                f"{path}: the {phase} graph file {graph.get('file')!r} is not listed in 'files', so it could not "
                "be verified; re-run the export"
            )
        for kind in ("inputs", "outputs"):
            entries = graph.get(kind)
            if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
                raise ManifestError(f"{path}: graphs.{phase}.{kind} must be a list of {{'name': ...}}; re-run the export")
    weights = manifest.get("weights")
    if weights is not None and weights not in files:
        raise ManifestError(f"{path}: the weights file {weights!r} is not listed in 'files'; re-run the export")


def load_manifest(folder: str | Path, verify_hashes: bool = False) -> dict[str, Any]:
    """Read and check `kvforge.json` (see the module docstring for what is checked).
    `verify_hashes` also re-hashes the large files (the weights), which reads them once."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder; pass the output folder of `kvforge export`")
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{folder} has no {MANIFEST_NAME}: it is not a kvforge export (run `kvforge export MODEL_DIR -o {folder}`)"
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); re-run the export") from err
    _validate(manifest, path)
    for name, record in manifest["files"].items():
        file = resolve_in_folder(folder, name, "the file")
        if not file.is_file():
            raise ManifestError(f"{folder} is missing {name}, which its manifest lists; re-run the export")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise ManifestError(f"{file} has {size} bytes, the manifest says {record['bytes']}: truncated or replaced; re-run the export")
        if (verify_hashes or size < SMALL_FILE_BYTES) and sha256_file(file) != record["sha256"]:
            raise ManifestError(
                f"{file} does not match the sha256 in {MANIFEST_NAME}: the file was modified or corrupted; re-run the export"
            )
    return manifest


def read_graph(folder: str | Path, manifest: dict[str, Any], phase: str) -> bytes:
    """The bytes of a phase's graph file, checked against the manifest's sha256: the runtime
    hands these very bytes to ONNX Runtime, so what is verified is what is loaded."""
    folder = Path(folder)
    name = manifest["graphs"][phase]["file"]
    path = resolve_in_folder(folder, name, f"the {phase} graph")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ManifestError(f"could not read {path}: {err.strerror or err}; re-run the export") from err
    record = manifest["files"].get(name)
    if record is None or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ManifestError(
            f"{path} does not match the sha256 in {MANIFEST_NAME}: the file was modified or corrupted; re-run the export"
        )
    return data
