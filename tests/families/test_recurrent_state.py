"""Recurrent state beside the KV cache (issue 35): Mamba / Mamba 2 layers (pure state-space models and
hybrids with attention) keep a conv state and an SSM state per row, bound in place like the KV buffers,
read and written by both graphs. Checked against Hugging Face eager; a batch of prompts of different
lengths, chunked prefill, a second turn from the prefix store and row moves on the device path must give
each prompt's own tokens; speculation and TensorRT refuse such a model in one line."""

from __future__ import annotations

import re

import numpy as np
import pytest
from serving import check_two_turns, greedy_alone

from kvforge.core.contract import KVLayout, StateSpec
from kvforge.core.errors import InputError, ManifestError, UnsupportedModelError
from kvforge.core.manifest import load_manifest
from kvforge.runtime import GenerationRequest, Generator
from kvforge.runtime.backends.kv_cache import KVCache
from kvforge.runtime.backends.ort_backend import OrtBackend
from kvforge.runtime.controls.request import Speculation
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.prefix_store import PrefixStore
from kvforge.runtime.drivers.scheduler import Scheduler

pytestmark = pytest.mark.xdist_group("recurrent-state")

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
           "def main(): return 42"]
# Which layers attend, per type: a hybrid (a Mamba 2 layer, then an attention layer), a pure state-space model
# (two Mamba layers), and Zamba / Zamba 2 (a Mamba layer, then two Mamba layers that each call one shared
# attention block first: each keeps its own keys and values, beside its state; Zamba's Mamba state is per head).
ATTENDS = {"bamba": [False, True], "mamba": [False, False], "zamba": [False, True, True],
           "zamba2": [False, True, True]}
# Families whose recurrent state lives outside transformers' cache (their family modules: models/families/state_binding.py): RWKV (two time shifts
# and the WKV numerator / denominator / maximum), MiniMax (full attention, then lightning attention's K^T V),
# RecurrentGemma (an RG-LRU block's conv and recurrent states, then local attention), xLSTM (mLSTM's C, n, m).
ATTENDS.update({"rwkv": [False, False], "minimax": [True, False], "recurrent_gemma": [False, True],
                "xlstm": [False, False]})
KINDS = {"rwkv": {"conv0", "conv1", "recurrent0", "recurrent1", "recurrent2"}, "minimax": {"recurrent0"},
         "xlstm": {"recurrent0", "recurrent1", "recurrent2"}}
STATELESS = {"bamba": {1}, "minimax": {0}, "recurrent_gemma": {1}}  # layers that only attend
TYPES = tuple(ATTENDS)


def test_a_layout_with_states_round_trips_and_names_its_buffers() -> None:
    states = (StateSpec(0, "conv0", (24, 4), "float32"), StateSpec(0, "recurrent0", (2, 8, 16), "float32"))
    layout = KVLayout.per_layer([None, (2, 16)], "float16", 512, states)
    assert layout.buffers() == [(0, "conv0"), (0, "recurrent0"), (1, "key"), (1, "value")]
    assert layout.cache_inputs() == ["past_conv0.0", "past_recurrent0.0", "past_key.1", "past_value.1"]
    assert layout.buffer_shape(3, 64, 0, "recurrent0") == (3, 2, 8, 16)
    assert layout.bytes(1, 10) == (24 * 4 + 2 * 8 * 16) * 4 + 2 * 2 * 10 * 16 * 2
    assert KVLayout.from_manifest({"kv_cache": layout.to_manifest()}) == layout


@pytest.mark.parametrize("entry, named", [
    ({"layer": 5, "kind": "conv0", "shape": [4], "dtype": "float32"}, r"states\[0\]"),
    ({"layer": 0, "kind": "lstm", "shape": [4], "dtype": "float32"}, r"states\[0\]"),
    ({"layer": 0, "kind": "conv0", "shape": [1 << 20, 1 << 20], "dtype": "float32"}, r"states\[0\]"),
    ({"layer": 0, "kind": "conv0", "shape": [4], "dtype": "float64"}, r"states\[0\]"),
])
def test_a_bad_state_entry_is_named(entry, named) -> None:
    kv = {**KVLayout(2, 2, 16, "float32", 256).to_manifest(), "states": [entry]}
    with pytest.raises(ManifestError, match=named):
        KVLayout.from_manifest({"kv_cache": kv})


def test_row_operations_move_a_whole_state_row_and_the_written_positions(monkeypatch) -> None:
    from test_device_path import HostCudart

    from kvforge.core import cuda

    monkeypatch.setattr(cuda, "_cudart", HostCudart)
    # A 3-D state row is a 4-D buffer, like a key's: it must still move whole (Mamba 2's [heads, dim, state]).
    states = (StateSpec(0, "conv0", (6, 3), "float32"), StateSpec(0, "recurrent0", (2, 3, 5), "float32"))
    for on_device in (False, True):
        cache = KVCache(2, 3, 2, 8, 4, layer_shapes=[None, (2, 4)], states=states, on_device=on_device)
        rng = np.random.default_rng(1)
        rows = [(rng.random((6, 3), dtype=np.float32), rng.random((2, 3, 5), dtype=np.float32)),
                (rng.random((2, 5, 4), dtype=np.float32), rng.random((2, 5, 4), dtype=np.float32))]
        cache.write_rows(1, rows, 5)
        cache.copy_rows(1, cache, 2, 5)
        got = cache.read_rows(2, 5)
        for layer, want in zip(got, rows, strict=True):
            for a, b in zip(layer, want, strict=True):
                np.testing.assert_array_equal(a, b)
        assert not cache.read_rows(0, 5)[0][0].any()  # row 0 was never written
        with pytest.raises(InputError, match="conv0"):
            cache.write_rows(0, [(rows[0][1], rows[0][0]), rows[1]], 5)


def test_a_stored_state_is_reused_only_where_the_prompt_continues_all_of_it() -> None:
    store = PrefixStore(1 << 20, exact_only=True)
    kv = [(np.zeros(4, np.float32),)]
    store.store([1, 2, 3, 4], kv)
    assert store.lookup([1, 2, 3, 4, 5])[0] == 4
    assert store.lookup([1, 2, 3, 9, 9])[0] == 0  # shares 3 tokens, but the state is that of 4
    plain = PrefixStore(1 << 20)
    plain.store([1, 2, 3, 4], kv)
    assert plain.lookup([1, 2, 3, 9, 9])[0] == 3


@pytest.fixture(scope="module", params=TYPES)
def exported(request, tmp_path_factory):
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry
    from kvforge.tools.coverage_fixtures import build_tiny

    root = tmp_path_factory.mktemp(request.param)
    model = build_tiny(request.param, root / "hf")
    registry = trial_registry(request.param, type(model).__name__, model.config)
    for target in ("ort", "onnx"):
        export_model(root / "hf", root / target, target=target, families=registry)
    return request.param, root, model, registry


def test_the_export_keeps_each_recurrent_layers_state(exported) -> None:
    model_type, root, model, _ = exported
    layout = KVLayout.from_manifest(load_manifest(root / "ort"))
    kinds = {spec.kind for spec in layout.states}
    assert kinds == KINDS.get(model_type, {"conv0", "recurrent0"}), layout.states
    attends = [layout.has_kv(layer) for layer in range(layout.num_layers)]
    assert attends == ATTENDS[model_type]
    # every layer has its Mamba (or its own recurrent layer), but for the layers that only attend
    assert {spec.layer for spec in layout.states} == set(range(layout.num_layers)) - STATELESS.get(model_type, set())


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_parity_with_hf_and_a_batch_of_different_lengths_equals_each_alone(exported, target) -> None:
    from kvforge.tools.parity import run_parity

    _, root, model, _ = exported
    report = run_parity(root / "hf", root / target, PROMPTS, 24, 1e-3, perplexity_tokens=0, hf_model=model)
    assert report.passed, report.failure_reason()
    generator = Generator(root / target)
    ids = [generator.tokenizer.encode(text) for text in PROMPTS]
    assert len({len(row) for row in ids}) > 1
    batch = generator.generate(ids, max_new_tokens=12, greedy=True, ignore_eos=True).tokens
    assert batch == [generator.generate([row], max_new_tokens=12, greedy=True, ignore_eos=True).tokens[0]
                     for row in ids]


class _SimulatedDevice(OrtBackend):
    simulate_device = True


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device-path"])
def test_serving_with_chunked_prefill_and_a_second_turn_equals_each_alone(exported, device, monkeypatch) -> None:
    from test_device_path import HostCudart

    from kvforge.core import cuda

    _, root, _, _ = exported
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
        # A prompt that shares only part of a stored one cannot take its state: prefilled from scratch.
        branch = prompts[1][:6] + [7, 8, 9]
        tokens, _, done = scheduler.submit(GenerationRequest(branch, 5, SamplingConfig(greedy=True),
                                                             ignore_eos=True)).result()
        assert done.cached_tokens == 0 and tokens == greedy_alone(solo, branch, 5)
    finally:
        scheduler.close()


def test_speculation_is_refused_in_one_line(exported) -> None:
    _, root, _, _ = exported
    generator = Generator(root / "ort")
    with pytest.raises(InputError, match="recurrent layers keep a state"):
        generator.generate([[5, 6, 7, 5, 6, 7]], max_new_tokens=4, greedy=True, speculate="prompt-lookup")
    scheduler = Scheduler(generator, max_batch=2, max_seq_len=64)
    try:
        with pytest.raises(InputError, match="recurrent layers keep a state"):
            scheduler.submit(GenerationRequest([5, 6, 7], 4, SamplingConfig(greedy=True),
                                               speculation=Speculation("prompt-lookup")))
    finally:
        scheduler.close()


def test_tensorrt_refuses_a_recurrent_model_in_one_line(exported, tmp_path) -> None:
    from kvforge.engines.trt_build import build_engines
    from kvforge.exporter.export import export_model

    _, root, _, registry = exported
    with pytest.raises(UnsupportedModelError, match="keep a recurrent state.*--target ort"):
        export_model(root / "hf", tmp_path / "trt", target="trt", families=registry)
    assert not (tmp_path / "trt").exists()
    with pytest.raises(UnsupportedModelError, match="TensorRT engines do not carry"):
        build_engines(root / "onnx", tmp_path / "engines")


def test_the_traceable_recurrences_equal_hfs_own_per_token_forms() -> None:
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.mamba import modeling_mamba as mamba
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    from kvforge.exporter import recurrent

    torch.manual_seed(0)
    b, s, h, k, v = 2, 7, 4, 8, 6
    q, key, value = torch.randn(b, s, 2, k), torch.randn(b, s, 2, k), torch.randn(b, s, h, v)
    g, beta, state = -torch.rand(b, s, h), torch.rand(b, s, h), torch.randn(b, h, k, v)
    want = qwen3_next.torch_recurrent_gated_delta_rule(q, key, value, g=g, beta=beta, initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = recurrent.scan_gated_delta_rule(q, key, value, g=g, beta=beta, initial_state=state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    # Kimi's delta attention: a decay per key channel.
    q, key, g = torch.randn(b, s, h, k), torch.randn(b, s, h, k), -torch.rand(b, s, h, k)
    want = kimi.recurrent_kimi_delta_attention(q, key, value, g, beta, state, True, use_qk_l2norm_in_kernel=True)
    got = recurrent.scan_gated_delta_rule(q, key, value, g, beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    # Mamba's selective scan (HF's starts at zero: so does ours with no state read).
    inner, n = 6, 5
    x, dt, a_log = torch.randn(b, inner, s), torch.randn(b, inner, s), -torch.rand(inner, n)
    bb, cc, d, z, bias = torch.randn(b, n, s), torch.randn(b, n, s), torch.randn(inner), torch.randn(b, inner, s), \
        torch.randn(inner)
    want = mamba.mamba_selective_scan(x, dt, a_log, bb, cc, D=d, z=z, delta_bias=bias, delta_softplus=True,
                                      return_last_state=True)
    recurrent.note_recurrent_state(None)
    got = recurrent.scan_selective_scan(x, dt, a_log, bb, cc, D=d, z=z, delta_bias=bias, delta_softplus=True,
                                        return_last_state=True)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_the_traceable_mamba2_scan_equals_hfs_chunked_form_across_chunks() -> None:
    import torch
    from transformers.models.mamba2 import modeling_mamba2 as mamba2

    from kvforge.exporter import recurrent

    torch.manual_seed(0)
    b, s, h, p, g, n = 2, 11, 4, 3, 2, 5  # 11 positions: three chunks of 4, the last one padded
    args = (torch.randn(b, s, h, p), torch.randn(b, s, h), -torch.rand(h), torch.randn(b, s, g, n),
            torch.randn(b, s, g, n))
    options = {"D": torch.randn(h), "dt_bias": torch.randn(h), "initial_states": torch.randn(b, h, p, n),
               "dt_softplus": True, "return_final_states": True}
    want = mamba2.mamba2_chunk_scan(*args, chunk_size=4, **options)
    got = recurrent.scan_mamba2(*args, chunk_size=4, **options)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)


def test_an_fp16_export_of_a_model_with_an_fp32_residual_stream_loads_and_agrees_with_fp32(exported, tmp_path) -> None:
    # Mamba keeps its residual stream in fp32 (residual_in_fp32): the lm_head must take it in its own dtype.
    from kvforge.exporter.export import export_model

    model_type, root, _, registry = exported
    if model_type == "minimax":  # not its recurrent state: Mixtral's fp16 `ort` export fails the same way
        pytest.skip("an fp16 `ort` export of a MoE model does not load: its MoE node mixes fp16 and fp32 inputs")
    export_model(root / "hf", tmp_path / "fp16", target="ort", dtype="fp16", families=registry)
    half, full = Generator(tmp_path / "fp16"), Generator(root / "ort")
    prompt = half.tokenizer.encode(PROMPTS[1])
    tokens = half.generate([prompt], max_new_tokens=8, greedy=True, ignore_eos=True).tokens[0]
    assert tokens[:4] == full.generate([prompt], max_new_tokens=8, greedy=True, ignore_eos=True).tokens[0][:4]


def test_the_traceable_selective_scan_follows_zambas_per_head_loop_from_a_state() -> None:
    # Zamba's mixer keeps its state by head ([B, heads, head_dim, N]) and scans one head per call, in head order:
    # each call must start from its own head's slice of the state the layer read.
    import torch
    from transformers.models.zamba import modeling_zamba as zamba

    from kvforge.exporter import recurrent

    torch.manual_seed(0)
    b, heads, dim, n, s = 2, 3, 5, 4, 6
    x, dt, z = torch.randn(heads, b, dim, s), torch.randn(heads, b, dim, s), torch.randn(heads, b, dim, s)
    a, bb, cc = -torch.rand(heads, dim, n), torch.randn(heads, b, n, s), torch.randn(heads, b, n, s)
    d, bias = torch.randn(heads, dim), torch.randn(heads, dim)
    for start in (torch.zeros(b, heads, dim, n), torch.randn(b, heads, dim, n)):
        # HF's per-token form (its decode step), which takes a state, run over the positions one by one.
        state = start.clone()
        want = torch.stack([torch.stack([
            zamba.mamba_selective_state_update(state[:, h], x[h, ..., t], dt[h, ..., t], a[h], bb[h, ..., t],
                                               cc[h, ..., t], d[h], z=z[h, ..., t], dt_bias=bias[h], dt_softplus=True)
            for t in range(s)], dim=-1) for h in range(heads)])
        recurrent.note_recurrent_state(start)
        got = [recurrent.scan_selective_scan(x[h], dt[h], a[h], bb[h], cc[h], D=d[h], z=z[h], delta_bias=bias[h],
                                             delta_softplus=True, return_last_state=True) for h in range(heads)]
        torch.testing.assert_close(torch.stack([out for out, _ in got]), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.stack([final for _, final in got], dim=1), state, atol=1e-5, rtol=1e-5)
    # From a zero state, HF's sequence form (what Zamba's prefill calls per head).
    recurrent.note_recurrent_state(torch.zeros(b, heads, dim, n))
    for h in range(heads):
        want = zamba.mamba_selective_scan(x[h], dt[h], a[h], bb[h], cc[h], D=d[h], z=z[h], delta_bias=bias[h],
                                          delta_softplus=True)
        got = recurrent.scan_selective_scan(x[h], dt[h], a[h], bb[h], cc[h], D=d[h], z=z[h], delta_bias=bias[h],
                                            delta_softplus=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("exported", ["bamba"], indirect=True)
def test_prompts_of_different_lengths_need_row_moves_and_a_backend_without_them_says_so(exported) -> None:
    # Each row of a state model is prefilled alone and copied into the batch (StepEngine._prefill_alone): a
    # backend that cannot move rows refuses the batch in one line, and still serves prompts of one length.
    from kvforge.core.errors import BackendUnavailableError

    _, root, _, _ = exported
    generator = Generator(root / "ort")
    generator.backend.copy_rows = None  # this backend instance, without the row operation
    with pytest.raises(BackendUnavailableError, match="cannot move cache rows") as refused:
        generator.generate([[5, 6, 7], [5, 6, 7, 8, 9]], max_new_tokens=3, greedy=True, ignore_eos=True)
    assert "\n" not in str(refused.value) and "one length per call" in str(refused.value)
    same = generator.generate([[5, 6, 7], [9, 8, 7]], max_new_tokens=3, greedy=True, ignore_eos=True).tokens
    assert same == [greedy_alone(Generator(root / "ort"), row, 3) for row in ([5, 6, 7], [9, 8, 7])]


def test_the_prefix_store_is_bounded_in_entries_too() -> None:
    # Bounded only by bytes, 5,024 tiny entries made every lookup scan them all (issue 43, 2).
    store = PrefixStore(1 << 30, max_entries=3)
    kv = [(np.zeros(4, np.float32),)]
    for first in range(5):
        store.store([first, 7, 8], kv)
    assert len(store) == 3 and store.lookup([0, 7, 8, 9])[0] == 0 and store.lookup([4, 7, 8, 9])[0] == 3


@pytest.mark.parametrize(("shapes", "why"), [
    ([None, None], "this model has no attention layers (it keeps recurrent state only)"),
    ([None, (2, 16)], "this model mixes attention layers with recurrent-state layers"),
], ids=["mamba", "hybrid"])
def test_an_int8_kv_cache_refusal_says_what_the_model_keeps(shapes, why) -> None:
    # It said the layers "differ" for a model with no KV cache at all (issue 43, 13).
    from types import SimpleNamespace

    from kvforge.exporter.quantization.kv_cache import calibrate

    states = tuple(StateSpec(i, "recurrent0", (2, 8, 16), "float32") for i, s in enumerate(shapes) if s is None)
    layout = KVLayout.per_layer(shapes, "float32", 64, states)
    with pytest.raises(UnsupportedModelError, match=re.escape(f"mamba: --kv-cache int8 quantises an attention KV "
                                                              f"cache with one head count and head size in every "
                                                              f"layer, and {why}; export without --kv-cache")):
        calibrate(None, SimpleNamespace(model_type="mamba"), None, layout, None, "int8")
