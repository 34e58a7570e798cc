"""`kvforge inspect`: what an export folder holds, from its manifest (no onnx import needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.contract import PHASES
from kvforge.core.manifest import load_manifest, read_graph


def describe(export_dir: str | Path, verify: bool = False) -> dict[str, Any]:
    """The manifest's view of an export folder, checked as a loader checks it; `verify` re-hashes
    every file (weights included), so `verified` says whether that was done."""
    manifest = load_manifest(export_dir, verify_hashes=verify)
    for phase in PHASES:  # as a backend reads them: the files their external data comes from must be listed
        read_graph(export_dir, manifest, phase)
    graphs = {}
    for phase, graph in manifest["graphs"].items():
        graphs[phase] = {
            "file": graph["file"],
            "nodes": graph.get("nodes"),
            "attention_nodes": graph.get("attention"),
            "op_counts": graph.get("op_counts", {}),
            "inputs": graph["inputs"],
            "outputs": graph["outputs"],
        }
    return {"folder": str(Path(export_dir).resolve()), "verified": verify, "graphs": graphs,
            "files": manifest["files"], "manifest": manifest}
