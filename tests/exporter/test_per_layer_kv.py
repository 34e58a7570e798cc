"""Per-layer KV shapes (issue 35): a model whose layers differ in KV head count or head size (Gemma 4's
full-attention layers have a wider head than its sliding ones) gets one key/value buffer shape per layer,
in the contract, the manifest, the graphs, the CPU and device caches and every row operation."""

from __future__ import annotations

import numpy as np
import pytest
from serving import check_two_turns

from kvforge.core.contract import KVLayout
from kvforge.core.errors import InputError, ManifestError
from kvforge.core.manifest import load_manifest
from kvforge.runtime import Generator
from kvforge.runtime.backends.kv_cache import KVCache
from kvforge.runtime.backends.ort_backend import OrtBackend
from kvforge.runtime.drivers.scheduler import Scheduler

pytestmark = pytest.mark.xdist_group("per-layer-kv")

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
           "def main(): return 42"]


def test_a_per_layer_layout_round_trips_and_a_uniform_one_keeps_its_manifest_form() -> None:
    mixed = KVLayout.per_layer([(2, 16), (2, 16), (1, 64)], "float32", 256)
    assert mixed.layers and mixed.shape(3, 32, 2) == (3, 1, 32, 64) and mixed.shape(3, 32, 0) == (3, 2, 32, 16)
    assert mixed.bytes(1, 10) == 2 * 10 * (2 * 16 * 2 + 64) * 4
    assert KVLayout.from_manifest({"kv_cache": mixed.to_manifest()}) == mixed
    uniform = KVLayout.per_layer([(2, 16)] * 3, "float32", 256)
    assert uniform == KVLayout(3, 2, 16, "float32", 256) and "layers" not in uniform.to_manifest()


@pytest.mark.parametrize("layers, named", [
    ([{"num_kv_heads": 2, "head_dim": 16}], "a list of 3 entries"),
    ([{"num_kv_heads": 2, "head_dim": 16}] * 2 + [{"num_kv_heads": 0, "head_dim": 16}], "layers[2]"),
    ([{"num_kv_heads": 2, "head_dim": 16}] * 2 + [{"num_kv_heads": 2, "head_dim": 10**9}], "layers[2]"),
    ("wide", "a list of 3 entries"),
])
def test_a_bad_per_layer_entry_is_named(layers, named) -> None:
    kv = {**KVLayout(3, 2, 16, "float32", 256).to_manifest(), "layers": layers}
    with pytest.raises(ManifestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        KVLayout.from_manifest({"kv_cache": kv})


def test_cpu_and_device_row_operations_move_every_layer_at_its_own_shape(monkeypatch) -> None:
    from test_device_path import HostCudart

    from kvforge.core import cuda

    monkeypatch.setattr(cuda, "_cudart", HostCudart)
    shapes = [(2, 4), (1, 8)]
    for on_device in (False, True):
        cache = KVCache(2, 3, 2, 8, 4, layer_shapes=shapes, on_device=on_device)
        assert [tuple(v.shape()) for v in cache.keys] == [(3, 2, 8, 4), (3, 1, 8, 8)]
        rng = np.random.default_rng(0)
        rows = [(rng.random((h, 5, d), dtype=np.float32), rng.random((h, 5, d), dtype=np.float32)) for h, d in shapes]
        cache.write_rows(1, rows, 5)
        cache.copy_rows(1, cache, 2, 5)
        for (key, value), (want_key, want_value) in zip(cache.read_rows(2, 5), rows, strict=True):
            np.testing.assert_array_equal(key, want_key)
            np.testing.assert_array_equal(value, want_value)
        with pytest.raises(InputError, match="layer 1's key cache"):
            cache.write_rows(0, [rows[0], rows[0]], 5)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """gemma4_text's tiny config (sliding layers of head size 16, a full-attention layer of 512), exported on
    `ort` and `onnx`, with its HF folder and model."""
    from kvforge.exporter.export import export_model
    from kvforge.tools.coverage_fixtures import build_tiny

    root = tmp_path_factory.mktemp("gemma4")
    model = build_tiny("gemma4_text", root / "hf")
    for target in ("ort", "onnx"):
        export_model(root / "hf", root / target, target=target)
    return root, model


def test_the_export_records_each_layers_shape(gemma4) -> None:
    root, model = gemma4
    layout = KVLayout.from_manifest(load_manifest(root / "ort"))
    types = model.config.layer_types
    assert len(set(layout.layer_shapes())) == 2, layout
    for layer, kind in enumerate(types):
        attention = model.model.layers[layer].self_attn
        assert layout.layer_shape(layer)[1] == attention.head_dim, (layer, kind)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_per_layer_shapes_export_at_parity_and_a_batch_equals_each_alone(gemma4, target) -> None:
    from kvforge.tools.parity import run_parity

    root, model = gemma4
    report = run_parity(root / "hf", root / target, PROMPTS, 24, 1e-3, perplexity_tokens=0, hf_model=model)
    assert report.passed, report.failure_reason()
    generator = Generator(root / target)
    ids = [generator.tokenizer.encode(text) for text in PROMPTS]
    batch = generator.generate(ids, max_new_tokens=12, greedy=True, ignore_eos=True).tokens
    assert batch == [generator.generate([row], max_new_tokens=12, greedy=True, ignore_eos=True).tokens[0]
                     for row in ids]


class _SimulatedDevice(OrtBackend):
    simulate_device = True


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device-path"])
def test_serving_with_chunked_prefill_and_a_second_turn_equals_each_alone(gemma4, device, monkeypatch) -> None:
    from test_device_path import HostCudart

    from kvforge.core import cuda

    root, _ = gemma4
    solo = Generator(root / "ort")
    if device:
        monkeypatch.setattr(cuda, "_cudart", HostCudart)
        served_by = Generator(root / "ort", backend=_SimulatedDevice(root / "ort", load_manifest(root / "ort")))
    else:
        served_by = Generator(root / "ort")
    prompts = [solo.tokenizer.encode(text) for text in PROMPTS]
    scheduler = Scheduler(served_by, max_batch=2, max_seq_len=128, prefill_chunk=5).start()
    try:
        check_two_turns(scheduler, solo, prompts)
    finally:
        scheduler.close()
