"""An export is a function of the model and the tool versions only: not of the torch thread count,
nor of the process it runs in (the demo converts a GGUF and exports in one process; `kvforge export`
runs alone). Issue 17: a demo export's RoPE table once differed from a CLI export's.

The graphs are compared byte for byte (every constant included, the rotary cos/sin tables of
GroupQueryAttention among them) and the shared weights file by sha256.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import numpy_helper  # noqa: E402

from kvforge.exporter.fusions import rotary_caches  # noqa: E402
from kvforge.exporter.load import load_hf_model  # noqa: E402

GRAPHS = ("prefill.onnx", "decode.onnx")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a graph file: initializers (external data loaded) and Constant values."""
    model = onnx.load(str(path), load_external_data=True)
    tensors = {f"initializer {t.name}": numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.type == onnx.AttributeProto.TENSOR:
                tensors[f"constant {node.output[0]} ({attr.t.name})"] = numpy_helper.to_array(attr.t)
    return tensors


def assert_same_export(a: Path, b: Path) -> None:
    """Same graph bytes and same weights file; on a difference, name the tensors that differ."""
    for name in GRAPHS:
        if (a / name).read_bytes() == (b / name).read_bytes():
            continue
        ta, tb = _tensors(a / name), _tensors(b / name)
        differ = [
            f"{key} {ta[key].shape}: max |diff| "
            f"{np.abs(ta[key].astype(np.float64) - tb[key].astype(np.float64)).max():.3g}"
            for key in sorted(set(ta) & set(tb))
            if ta[key].shape == tb[key].shape and ta[key].tobytes() != tb[key].tobytes()
        ]
        others = sorted(set(ta) ^ set(tb)) or ["(only the graph structure or names)"]
        pytest.fail(f"{name} differs between {a} and {b}: " + "; ".join(differ or others))
    assert _sha256(a / "model.weights") == _sha256(b / "model.weights")


def _cli_export(source: Path, out: Path, threads: int) -> None:
    """`kvforge export` in a fresh process with its own thread count."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    code = (f"import torch; torch.set_num_threads({threads}); "
            "from kvforge.cli import main; main()")
    result = subprocess.run(
        [sys.executable, "-c", code, "export", str(source), "-o", str(out), "--target", "ort"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("recipe", ["llama-tiny", "llama3-tiny"])
def test_rotary_tables_are_hf_fp32_angles_rounded_once(recipe, hf_folder) -> None:
    # The tables GroupQueryAttention gets are defined exactly: cos/sin of HF's fp32 angle
    # (fp32 position * fp32 inv_freq), computed in double precision and rounded once to fp32.
    # torch's own cos/sin (MKL's VML, SLEEF or libm, by build and CPU) miss that by an ulp in ~5% of
    # the entries, each in its own; an exact definition is what makes the export reproducible.
    model = load_hf_model(hf_folder(recipe))
    rope = model.model.rotary_emb
    positions = model.config.max_position_embeddings
    cos, sin = rotary_caches(model, positions, "float32")
    inv_freq = rope.inv_freq.float().numpy()
    scaling = float(rope.attention_scaling)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    # Python's math (libm), not numpy, for the reference.
    want_cos = np.array([[math.cos(float(x)) * scaling for x in row] for row in angles], np.float32)
    want_sin = np.array([[math.sin(float(x)) * scaling for x in row] for row in angles], np.float32)
    assert cos.dtype == np.float32 and cos.shape == (positions, inv_freq.shape[0])
    mismatched = {"cos": int((cos != want_cos).sum()), "sin": int((sin != want_sin).sum())}
    assert mismatched == {"cos": 0, "sin": 0}, f"entries not equal to the reference (of {cos.size} each)"
    # And they are what HF eager uses at run time, to rounding.
    with torch.no_grad():
        hf_cos, hf_sin = rope(torch.zeros(1), torch.arange(positions)[None])
    half = cos.shape[1]
    assert np.abs(hf_cos[0, :, :half].numpy() - cos).max() < 1e-6
    assert np.abs(hf_sin[0, :, half:].numpy() - sin).max() < 1e-6


def test_rotary_tables_do_not_depend_on_the_thread_count(hf_folder) -> None:
    model = load_hf_model(hf_folder("llama-tiny"))
    saved = torch.get_num_threads()
    tables = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cos, sin = rotary_caches(model, model.config.max_position_embeddings, "float32")
            tables[threads] = cos.tobytes() + sin.tobytes()
    finally:
        torch.set_num_threads(saved)
    assert tables[1] == tables[2]


def test_in_process_and_cli_exports_are_identical(hf_folder, tmp_path) -> None:
    # The demo's way (export_model in a process that did other work first, here 1 torch thread)
    # against `kvforge export` in a fresh process with 2 threads.
    from kvforge.exporter.export import export_model

    source = hf_folder("llama-tiny")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        export_model(source, tmp_path / "in-process", target="ort")
    finally:
        torch.set_num_threads(saved)
    _cli_export(source, tmp_path / "cli", threads=2)
    assert_same_export(tmp_path / "in-process", tmp_path / "cli")


def test_the_demo_does_not_reuse_an_export_made_by_other_exporter_code(exported, hf_folder, tmp_path) -> None:
    # kvforge's version string is the same across commits: the demo's cache must also match the exporter's
    # source digest (and the tool versions), or it re-exports instead of serving a stale export. It says which
    # changed (it re-exported silently: issue 53, first hour 6), and that the check hashes before it does.
    import json
    import shutil
    from importlib import metadata

    from kvforge.cli.demo import _reuse, _stale
    from kvforge.exporter.export_manifest import exporter_source_digest

    folder = shutil.copytree(exported("llama-tiny"), tmp_path / "export")
    source = hf_folder("llama-tiny")
    manifest = json.loads((folder / "kvforge.json").read_text())
    assert manifest["kvforge_source"] == exporter_source_digest()
    said: list[str] = []
    assert _stale(folder, "ort", source, None) is None and _reuse(folder, "ort", source, None, said.append)
    assert said == [f"checking the cached export {folder} (hashing kvforge's exporter source, comparing tool versions)",
                    f"reusing the cached export {folder}"]  # reused while nothing changed
    manifest["kvforge_source"] = "0" * 16  # as if written by another commit of the exporter
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    assert _stale(folder, "ort", source, None) == "kvforge's exporter source changed"
    manifest["kvforge_source"] = exporter_source_digest()
    manifest["tools"]["torch"] = "0.0.1"  # or by another torch
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    said.clear()
    assert not _reuse(folder, "ort", source, None, said.append)
    assert said[-1] == f"re-exporting {folder}: torch 0.0.1 -> {metadata.version('torch')}"
    assert _stale(tmp_path / "nothing-there", "ort", source, None) == ""  # a first run: nothing to say
