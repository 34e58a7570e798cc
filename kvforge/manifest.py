"""The export folder's manifest, `kvforge.json`: written by the exporter, checked by every loader.

Kept free of torch/onnx so the runtime can read it. Shapes and names the runtime needs come
from here, never from model code.

Layout of the file (format "kvforge/1"):

    {
      "format": "kvforge/1",
      "kvforge_version": "0.1.0",
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
prefill only `logits_index [B] int64` (which position of S to return logits for),
`past_key.{i}` / `past_value.{i}` `[B, H_kv, C, D]`; outputs `logits [B, V]` and
`present_key.{i}` / `present_value.{i}` (same shape, bound to the same buffers as the past).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvforge.errors import ManifestError

FORMAT = "kvforge/1"
MANIFEST_NAME = "kvforge.json"
PHASES = ("prefill", "decode")


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


def load_manifest(folder: str | Path, verify_hashes: bool = False) -> dict[str, Any]:
    """Read and check `kvforge.json`. `verify_hashes` re-hashes every file (slow for big weights);
    sizes are always checked, which catches truncated copies cheaply."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder; pass the output folder of `kvforge export`")
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{folder} has no {MANIFEST_NAME}: it is not a kvforge export (run `kvforge export MODEL_DIR -o {folder}`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); re-run the export") from err
    if manifest.get("format") != FORMAT:
        raise ManifestError(
            f"{path} has format {manifest.get('format')!r}, this kvforge reads {FORMAT!r}; re-export with this version"
        )
    for key in ("model", "target", "dtype", "kv_cache", "graphs", "files"):
        if key not in manifest:
            raise ManifestError(f"{path} lacks the {key!r} entry; re-run the export")
    for phase in PHASES:
        if phase not in manifest["graphs"]:
            raise ManifestError(f"{path} lists no {phase!r} graph; re-run the export")
    for name, record in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise ManifestError(f"{folder} is missing {name}, which its manifest lists; re-run the export")
        if file.stat().st_size != record["bytes"]:
            raise ManifestError(
                f"{file} has {file.stat().st_size} bytes, the manifest says {record['bytes']}: truncated or replaced"
            )
        if verify_hashes and sha256_file(file) != record["sha256"]:
            raise ManifestError(f"{file} does not match the sha256 in {MANIFEST_NAME}: the folder was modified")
    return manifest
