"""kvforge/engines/trt_graph.py: what the build hands TensorRT's parser, checked on ONNX Runtime (no TensorRT needed).

The rewritten graph must compute what the export computes: a static capacity changes no value, and
Gemma 2's softcapped attention, decomposed into plain ops for TensorRT, matches ONNX Attention with
softcap (prefill with a window shorter than the prompt, then a decode step over the cache it wrote)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

import onnxruntime as ort  # noqa: E402

from kvforge.core.contract import KVLayout  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.engines.trt_graph import tensorrt_graph  # noqa: E402

CAPACITY = 48


def _session(folder, graph: str, rewrite: bool) -> tuple[ort.InferenceSession, int]:
    manifest = load_manifest(folder)
    path = folder / f"{graph}.onnx"
    decomposed = 0
    if rewrite:
        kv = KVLayout.from_manifest(manifest)
        caches = set(kv.cache_inputs()) | set(kv.cache_outputs())
        proto, decomposed = tensorrt_graph(path, caches, CAPACITY, manifest["model"]["num_heads"], kv.num_kv_heads,
                                           kv.head_dim)
        path = folder / f"{graph}.rewritten.onnx"  # beside the weights file its initializers point into
        onnx.save(proto, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), decomposed


def _run(session: ort.InferenceSession, manifest: dict, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.mark.parametrize(("recipe", "softcapped"), [("gemma2-tiny", True), ("llama-tiny", False)])
def test_rewritten_graphs_compute_what_the_export_computes(recipe, softcapped, exported, tmp_path) -> None:
    folder = shutil.copytree(exported(recipe, "onnx", "fp32"), tmp_path / "export")
    manifest = load_manifest(folder)
    kv = manifest["kv_cache"]
    layers, shape = kv["num_layers"], (2, kv["num_kv_heads"], CAPACITY, kv["head_dim"])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, manifest["model"]["vocab_size"], size=(2, 23)).astype(np.int64)  # past the 16-token window
    outputs = {}
    for rewrite in (False, True):
        prefill, decomposed = _session(folder, "prefill", rewrite)
        decode, _ = _session(folder, "decode", rewrite)
        if rewrite:
            assert decomposed == (layers if softcapped else 0)
        cache = {f"past_{k}.{i}": np.zeros(shape, np.float32) for i in range(layers) for k in ("key", "value")}
        feeds = {"input_ids": ids, "past_lens": np.array([0, 0], np.int32),
                 "logits_index": np.array([[22], [22]], np.int64), **cache}
        first = _run(prefill, manifest, feeds)
        cache = {name.replace("present_", "past_"): value for name, value in first.items() if name != "logits"}
        step = _run(decode, manifest, {"input_ids": ids[:, :1], "past_lens": np.array([23, 23], np.int32), **cache})
        outputs[rewrite] = (first["logits"], step["logits"])
    for original, rewritten in zip(outputs[False], outputs[True], strict=True):
        np.testing.assert_allclose(rewritten, original, atol=1e-4, rtol=0)
    assert np.abs(outputs[True][1]).max() > 1e-2  # logits that matter, not zeros on both sides


def test_softcap_decomposition_is_sensitive_to_the_softcap(exported, tmp_path) -> None:
    # The comparison above can fail: a decomposition that drops the cap gives other logits.
    from kvforge.engines import trt_graph

    folder = shutil.copytree(exported("gemma2-tiny", "onnx", "fp32"), tmp_path / "export")
    manifest = load_manifest(folder)
    model = manifest["model"]
    real = trt_graph._float_attr

    def no_cap(node, name, default=0.0):
        value = real(node, name, default)
        return 1e6 if name == "softcap" and value > 0 else value

    original = trt_graph._float_attr
    trt_graph._float_attr = no_cap
    try:
        kv = KVLayout.from_manifest(manifest)
        proto, _ = tensorrt_graph(folder / "prefill.onnx", set(), None, model["num_heads"], kv.num_kv_heads, kv.head_dim)
    finally:
        trt_graph._float_attr = original
    onnx.save(proto, str(folder / "uncapped.onnx"))
    kv = manifest["kv_cache"]
    cache = {f"past_{k}.{i}": np.zeros((1, kv["num_kv_heads"], CAPACITY, kv["head_dim"]), np.float32)
             for i in range(kv["num_layers"]) for k in ("key", "value")}
    ids = np.arange(3, 26, dtype=np.int64)[None]
    feeds = {"input_ids": ids, "past_lens": np.array([0], np.int32), "logits_index": np.array([[22]], np.int64), **cache}
    capped = ort.InferenceSession(str(folder / "prefill.onnx")).run(["logits"], feeds)[0]
    uncapped = ort.InferenceSession(str(folder / "uncapped.onnx")).run(["logits"], feeds)[0]
    assert np.abs(capped - uncapped).max() > 1e-2
