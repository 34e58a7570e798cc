"""Generator over a hand-built export folder that obeys the KV cache contract.

The toy model (token + learned position embeddings, two layers of com.microsoft.GroupQueryAttention
with a residual, an output projection) is small enough to recompute in numpy without any cache:
that full recomputation is the oracle. It checks right padding, logits_index, past_lens positions,
in-place KV writes into the runtime's own buffers, stopping, and streaming, without the exporter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from kvforge.core.errors import BackendUnavailableError, CapacityError, InputError, ManifestError
from kvforge.core.manifest import FORMAT, file_record, write_manifest
from kvforge.runtime import Generator, SamplingConfig
from kvforge.runtime.drivers import inspection

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MAX_POS = 61, 32, 4, 2, 8, 2, 64
PAD, BOS, EOS = 0, 1, 2
WEIGHTS = "model.weights"


def toy_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {
        "tok_emb": normal(VOCAB, HIDDEN, scale=1.0),
        "pos_emb": normal(MAX_POS, HIDDEN, scale=1.0),
        "w_out": normal(HIDDEN, VOCAB, scale=HIDDEN**-0.5),
    }
    for i in range(LAYERS):
        # Large q/k and o scales: attention is sharp and the layers move the logits a lot, so a
        # wrong cache position or a missing row changes the greedy tokens (see DESIGN pitfalls).
        weights[f"wq.{i}"] = normal(HIDDEN, HEADS * HEAD_DIM, scale=1.5 * HIDDEN**-0.5)
        weights[f"wk.{i}"] = normal(HIDDEN, KV_HEADS * HEAD_DIM, scale=1.5 * HIDDEN**-0.5)
        weights[f"wv.{i}"] = normal(HIDDEN, KV_HEADS * HEAD_DIM, scale=HIDDEN**-0.5)
        weights[f"wo.{i}"] = normal(HEADS * HEAD_DIM, HIDDEN, scale=2.0 * (HEADS * HEAD_DIM) ** -0.5)
    return weights


# -- the numpy oracle: full recomputation, no cache ---------------------------------------------
def reference_forward(weights: dict[str, np.ndarray], ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits [S, V] of every position and layer-wise K [H_kv, S, D] of one sequence."""
    ids_arr = np.asarray(ids)
    seq = len(ids)
    h = weights["tok_emb"][ids_arr] + weights["pos_emb"][np.arange(seq)]
    keys = []
    group = HEADS // KV_HEADS
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    for i in range(LAYERS):
        q = (h @ weights[f"wq.{i}"]).reshape(seq, HEADS, HEAD_DIM).transpose(1, 0, 2)
        k = (h @ weights[f"wk.{i}"]).reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        v = (h @ weights[f"wv.{i}"]).reshape(seq, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)
        keys.append(k)
        k_rep, v_rep = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        scores = q @ k_rep.transpose(0, 2, 1) / np.sqrt(HEAD_DIM)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v_rep).transpose(1, 0, 2).reshape(seq, HEADS * HEAD_DIM)
        h = h + out @ weights[f"wo.{i}"]
    return h @ weights["w_out"], keys


def reference_greedy(weights: dict[str, np.ndarray], prompt: list[int], new: int, eos: int = EOS) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(new):
        logits, _ = reference_forward(weights, ids)
        token = int(np.argmax(logits[-1]))
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


# -- the export folder ----------------------------------------------------------------------------
def _external(name: str, array: np.ndarray, offset: int) -> TensorProto:
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend(array.shape)
    for key, value in (("location", WEIGHTS), ("offset", str(offset)), ("length", str(array.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = TensorProto.EXTERNAL
    return tensor


def build_graph(phase: str, weights: dict[str, np.ndarray], offsets: dict[str, int]) -> onnx.ModelProto:
    prefill = phase == "prefill"
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kv_shape = ["batch", KV_HEADS, "capacity", HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch", "seq" if prefill else 1]),
        helper.make_tensor_value_info("past_lens", i32, ["batch"]),
    ]
    if prefill:
        inputs.append(helper.make_tensor_value_info("logits_index", i64, ["batch", "positions"]))
    logits_shape = ["batch", "positions", VOCAB] if prefill else ["batch", VOCAB]
    outputs = [helper.make_tensor_value_info("logits", f32, logits_shape)]
    for i in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"past_{kind}.{i}", f32, kv_shape) for kind in ("key", "value")]
        outputs += [helper.make_tensor_value_info(f"present_{kind}.{i}", f32, kv_shape) for kind in ("key", "value")]
    consts = [
        helper.make_tensor("c0", i64, [], [0]),
        helper.make_tensor("c1", i64, [], [1]),
        helper.make_tensor("one_vec", i64, [1], [1]),
    ]
    if prefill:
        consts += [helper.make_tensor("vocab_vec", i64, [1], [VOCAB]), helper.make_tensor("two_vec", i64, [1], [2])]
    n = helper.make_node
    nodes = [
        n("Shape", ["input_ids"], ["seq_1"], start=1, end=2),
        n("Squeeze", ["seq_1"], ["seq"]),
        n("Range", ["c0", "seq", "c1"], ["steps"]),
        n("Cast", ["past_lens"], ["past64"], to=i64),
        n("Unsqueeze", ["past64", "one_vec"], ["past_col"]),
        n("Unsqueeze", ["steps", "c0"], ["steps_row"]),
        n("Add", ["past_col", "steps_row"], ["positions"]),  # past_lens[b] + 0..S-1
        n("Gather", ["tok_emb", "input_ids"], ["tok"]),
        n("Gather", ["pos_emb", "positions"], ["pos"]),
        n("Add", ["tok", "pos"], ["h_in"]),
        n("Add", ["past64", "seq"], ["total_b"]),
        n("Sub", ["total_b", "c1"], ["seqlens64"]),
        n("Cast", ["seqlens64"], ["seqlens_k"], to=i32),
        n("ReduceMax", ["total_b"], ["total64"], keepdims=0),
        n("Cast", ["total64"], ["total_len"], to=i32),
    ]
    h = "h_in"
    for i in range(LAYERS):
        nodes += [
            n("MatMul", [h, f"wq.{i}"], [f"q.{i}"]),
            n("MatMul", [h, f"wk.{i}"], [f"k.{i}"]),
            n("MatMul", [h, f"wv.{i}"], [f"v.{i}"]),
            n(
                "GroupQueryAttention",
                [f"q.{i}", f"k.{i}", f"v.{i}", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_len"],
                [f"attn.{i}", f"present_key.{i}", f"present_value.{i}"],
                domain="com.microsoft",
                num_heads=HEADS,
                kv_num_heads=KV_HEADS,
            ),
            n("MatMul", [f"attn.{i}", f"wo.{i}"], [f"proj.{i}"]),
            n("Add", [h, f"proj.{i}"], [f"h.{i}"]),
        ]
        h = f"h.{i}"
    nodes.append(n("MatMul", [h, "w_out"], ["logits_all"]))
    if prefill:
        # logits[b, k] = logits_all[b, logits_index[b, k]]: [B, K, V]
        nodes += [
            n("Shape", ["logits_index"], ["index_shape"]),
            n("Concat", ["index_shape", "vocab_vec"], ["gather_shape"], axis=0),
            n("Unsqueeze", ["logits_index", "two_vec"], ["idx3"]),
            n("Expand", ["idx3", "gather_shape"], ["idx_full"]),
            n("GatherElements", ["logits_all", "idx_full"], ["logits"], axis=1),
        ]
    else:
        nodes.append(n("Squeeze", ["logits_all", "one_vec"], ["logits"]))
    initializers = consts + [_external(name, array, offsets[name]) for name, array in weights.items()]
    graph = helper.make_graph(nodes, f"toy_{phase}", inputs, outputs, initializer=initializers)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10  # onnxruntime 1.31 refuses IR > 13; onnx 1.23 writes 14
    return model


def build_tokenizer() -> HFTokenizer:
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return tok


def build_export(folder: Path, seed: int = 0, eos: int = EOS, max_capacity: int = MAX_POS) -> dict[str, np.ndarray]:
    """Write a complete export folder; return the weights (for the oracle)."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = toy_weights(seed)
    offsets, blob = {}, bytearray()
    for name, array in weights.items():
        blob += b"\0" * (-len(blob) % 4096)  # page-aligned, as an exporter would for mmap
        offsets[name] = len(blob)
        blob += array.tobytes()
    (folder / WEIGHTS).write_bytes(bytes(blob))
    graphs = {}
    for phase in ("prefill", "decode"):
        model = build_graph(phase, weights, offsets)
        onnx.save_model(model, str(folder / f"{phase}.onnx"))
        graphs[phase] = {
            "file": f"{phase}.onnx",
            "inputs": [{"name": v.name} for v in model.graph.input],
            "outputs": [{"name": v.name, "dtype": "float32"} for v in model.graph.output],
        }  # no shapes: the runtime must cope with a manifest that states only names and dtypes
    build_tokenizer().save(str(folder / "tokenizer.json"))
    files = {name: file_record(folder / name) for name in ("prefill.onnx", "decode.onnx", WEIGHTS, "tokenizer.json")}
    write_manifest(
        folder,
        {
            "format": FORMAT,
            "model": {"architecture": "Toy", "vocab_size": VOCAB, "num_layers": LAYERS, "num_heads": HEADS,
                      "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_size": HIDDEN,
                      "max_position_embeddings": MAX_POS, "bos_token_id": BOS, "eos_token_id": [eos],
                      "pad_token_id": PAD},
            "target": "ort",
            "dtype": "fp32",
            "kv_cache": {"layout": "BNSH", "dtype": "float32", "num_layers": LAYERS, "num_kv_heads": KV_HEADS,
                         "head_dim": HEAD_DIM, "max_capacity": max_capacity},
            "graphs": graphs,
            "weights": WEIGHTS,
            "files": files,
            "generation": {},
        },
    )
    return weights


PROMPTS = [[1, 17, 33, 5, 48, 9, 22], [1, 40], [1, 7, 7, 30, 12]]


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("toy_export")
    return folder, build_export(folder)


@pytest.fixture(scope="module")
def expected(toy: tuple[Path, dict[str, np.ndarray]]) -> list[list[int]]:
    return [reference_greedy(toy[1], prompt, 12) for prompt in PROMPTS]


def test_oracle_is_sensitive_to_context(toy, expected) -> None:
    # Guard against a toy model that ignores attention: different histories must change the tokens.
    assert len({tuple(tokens) for tokens in expected}) == len(expected)
    weights = toy[1]
    a, _ = reference_forward(weights, [1, 17, 33, 5])
    b, _ = reference_forward(weights, [1, 40, 33, 5])
    assert np.argmax(a[-1]) != np.argmax(b[-1]) or not np.allclose(a[-1], b[-1], atol=1e-2)


def test_greedy_single_prompts_match_oracle(toy, expected) -> None:
    gen = Generator(toy[0])
    for prompt, want in zip(PROMPTS, expected, strict=True):
        result = gen.generate([prompt], max_new_tokens=12, greedy=True)
        assert result.tokens == [want]
        assert result.prompt_tokens == [len(prompt)]
        assert result.text is None  # token ids in -> token ids out
        reason = "eos" if want[-1] == EOS else "length"
        assert result.finish_reason == [reason]


def test_right_padded_batch_matches_oracle(toy, expected) -> None:
    gen = Generator(toy[0])
    result = gen.generate(PROMPTS, max_new_tokens=12, greedy=True)
    assert result.tokens == expected
    assert result.prompt_tokens == [len(p) for p in PROMPTS]


def test_cache_holds_reference_keys_in_the_runtime_buffers(toy) -> None:
    folder, weights = toy
    gen = Generator(folder)
    result = gen.generate(PROMPTS[:2], max_new_tokens=5, greedy=True)
    for b, prompt in enumerate(PROMPTS[:2]):
        fed = prompt + result.tokens[b][:-1]  # the last token is returned, never fed
        assert gen.cache.past_lens[b] == len(fed)
        _, ref_keys = reference_forward(weights, fed)
        for layer in range(LAYERS):
            keys, _ = inspection.read_kv(gen, layer)
            np.testing.assert_allclose(keys[b, :, : len(fed)], ref_keys[layer], rtol=1e-4, atol=1e-4)


def test_same_buffers_bound_at_every_step(toy) -> None:
    gen = Generator(toy[0])
    stream = gen.stream(PROMPTS, max_new_tokens=10, greedy=True)
    addresses = inspection.kv_addresses(gen)
    assert len(addresses) == 2 * LAYERS and len(set(addresses.values())) == 2 * LAYERS
    seen_steps = []
    for event in stream:
        phase = "prefill" if event.step == 0 else "decode"
        bound = inspection.bound_output_addresses(gen, phase)
        for i in range(LAYERS):
            assert bound[f"present_key.{i}"] == addresses[f"past_key.{i}"]
            assert bound[f"present_value.{i}"] == addresses[f"past_value.{i}"]
        assert inspection.kv_addresses(gen) == addresses
        seen_steps.append(event.step)
    assert seen_steps == list(range(len(seen_steps)))
    assert gen.runs == {"prefill": 1, "decode": stream.result.steps}
    # A second request of the same shape reuses the buffers instead of allocating new ones.
    gen.generate(PROMPTS, max_new_tokens=10, greedy=True)
    assert inspection.kv_addresses(gen) == addresses


def test_finished_rows_are_frozen(toy, expected) -> None:
    gen = Generator(toy[0])
    stop = expected[1][2]  # the 3rd token of prompt 1 ends that row early
    result = gen.generate(PROMPTS, max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    for b, want in enumerate(expected):
        cut = next((j + 1 for j, t in enumerate(want) if t in (stop, EOS)), len(want))
        assert result.tokens[b] == want[:cut]
    assert result.finish_reason[1] == "stop"
    # The stopped row was frozen: its fill level counts only the tokens it actually fed.
    assert gen.cache.past_lens[1] == len(PROMPTS[1]) + len(result.tokens[1]) - 1


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 0.7, "seed": 1}])
def test_a_nan_logit_in_a_decode_step_is_refused_with_its_step(toy, sampling) -> None:
    # One NaN in one row's logits at decode step 3, at a token that is not the row's maximum: greedy
    # checks only the picked logits (argmax picks a row's first NaN), sampling checks them all.
    from kvforge.core.errors import NumericalError

    gen = Generator(toy[0])
    decode = gen.backend.decode

    def poisoned(slot, token_ids, running=None):
        logits = decode(slot, token_ids, running)
        if gen.backend.runs["decode"] == 3:
            logits[1, int(np.argmin(logits[1]))] = np.nan
        return logits

    gen.backend.decode = poisoned
    with pytest.raises(NumericalError, match="the model produced NaN logits at step 3") as caught:
        gen.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, **sampling)
    assert caught.value.step == 3


def test_eos_from_manifest_stops(tmp_path, toy, expected) -> None:
    eos = expected[0][3]
    build_export(tmp_path / "eos", eos=eos)
    result = Generator(tmp_path / "eos").generate([PROMPTS[0]], max_new_tokens=12)
    want = reference_greedy(toy[1], PROMPTS[0], 12, eos=eos)
    assert want[-1] == eos
    assert result.tokens == [want]
    assert result.finish_reason == ["eos"]


def test_text_in_text_out_and_stream_deltas(toy) -> None:
    folder, weights = toy
    gen = Generator(folder)
    prompt = "w17 w33 w5"
    ids = [BOS, 17, 33, 5]  # the tokenizer's post-processor adds BOS
    want = reference_greedy(weights, ids, 6)
    result = gen.generate(prompt, max_new_tokens=6)
    assert result.prompt_tokens == [4]
    assert result.tokens == [want]
    expected_text = " ".join(f"w{t}" for t in want if t > EOS)
    assert result.text == [expected_text]
    stream = gen.stream([prompt], max_new_tokens=6)
    deltas = "".join(event.text[0] for event in stream)
    assert deltas == expected_text
    assert stream.result.tokens == [want]


def test_sampling_is_seeded_and_stays_in_top_k(toy) -> None:
    gen = Generator(toy[0])
    first = gen.generate(PROMPTS, max_new_tokens=8, temperature=1.5, top_k=3, seed=7)
    again = gen.generate(PROMPTS, max_new_tokens=8, sampling=SamplingConfig(greedy=False, temperature=1.5, top_k=3, seed=7))
    assert first.tokens == again.tokens
    # Each sampled token must be among the 3 most likely after its actual history.
    for prompt, tokens in zip(PROMPTS, first.tokens, strict=True):
        history = list(prompt)
        for token in tokens:
            logits, _ = reference_forward(toy[1], history)
            assert token in np.argsort(-logits[-1])[:3]
            history.append(token)


def test_timings_and_counts_are_reported(toy) -> None:
    result = Generator(toy[0]).generate(PROMPTS, max_new_tokens=4, greedy=True, stop_token_ids=[])
    assert result.steps == 3  # 1 token from prefill + 3 decode steps, unless EOS came first
    assert result.prefill_ms > 0 and result.ttft_ms >= result.prefill_ms
    assert result.decode_ms > 0 and result.decode_tokens_per_s > 0


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "message"),
    [
        ([[]], {}, InputError, "prompt 0 has no tokens"),
        ("", {}, InputError, "prompt 0 is empty"),
        ([], {}, InputError, "no prompts given"),
        ([[1, 5, VOCAB]], {}, InputError, f"token id {VOCAB}, outside the vocabulary [0, {VOCAB})"),
        ([[1, -1]], {}, InputError, "outside the vocabulary"),
        ([[1, 5]], {"max_new_tokens": 0}, InputError, "max_new_tokens must be an integer >= 1"),
        ([[1] * 60], {"max_new_tokens": 10}, CapacityError, "needs 69 positions"),
        ([[1] * 10], {"max_new_tokens": 10, "capacity": 12}, CapacityError,
         "needs 19 positions but the KV cache holds 12; raise capacity (max 64)"),
        ([[1] * 10], {"max_new_tokens": 5, "capacity": 65}, CapacityError, "exceeds the export's max_capacity 64"),
        ([[1, 5]], {"temperature": 0.0}, InputError, "temperature must be > 0"),
        ([[1, 5]], {"sampling": SamplingConfig(), "top_k": 3}, InputError, "not both"),
        (["w5", [1, 2]], {}, InputError, "not a mix"),
    ],
)
def test_bad_requests_raise_clear_errors(toy, prompts, kwargs, error, message) -> None:
    gen = Generator(toy[0])
    with pytest.raises(error) as info:
        gen.generate(prompts, **kwargs)
    assert message in str(info.value)


def test_bad_backend_and_missing_cuda(toy) -> None:
    with pytest.raises(InputError, match="unknown backend 'tpu'"):
        Generator(toy[0], backend="tpu")
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA is available here; the unavailable-backend error cannot be provoked")
    with pytest.raises(BackendUnavailableError, match="CUDAExecutionProvider"):
        Generator(toy[0], backend="ort-cuda")


def test_manifest_io_mismatch_is_refused(tmp_path) -> None:
    folder = tmp_path / "bad"
    build_export(folder)
    manifest = json.loads((folder / "kvforge.json").read_text())
    manifest["graphs"]["decode"]["inputs"] = [e for e in manifest["graphs"]["decode"]["inputs"] if e["name"] != "past_lens"]
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="does not follow the KV cache contract"):
        Generator(folder)


def test_session_modes_give_the_same_tokens(toy, expected) -> None:
    # "single": one session (the prefill graph) serves both phases, so one weight copy whatever ORT
    # prepacks. "shared": two sessions over ORT's memory map of the weights file, prepacking off.
    # "separate": two sessions, each free to prepack its own copy. Memory is measured in benchmarks.
    single, shared, separate = (Generator(toy[0], sessions=mode) for mode in ("single", "shared", "separate"))
    assert single.backend.sessions["prefill"] is single.backend.sessions["decode"]
    assert shared.backend.sessions["prefill"] is not shared.backend.sessions["decode"]
    for session in shared.backend.sessions.values():
        assert session.get_session_options().get_session_config_entry("session.disable_prepacking") == "1"
    for session in separate.backend.sessions.values():
        with pytest.raises(RuntimeError, match="does not have configuration"):  # ORT's default: prepack
            session.get_session_options().get_session_config_entry("session.disable_prepacking")
    for gen in (single, shared, separate):
        assert gen.generate(PROMPTS, max_new_tokens=12, greedy=True).tokens == expected


def test_unknown_session_mode(toy) -> None:
    with pytest.raises(InputError, match="unknown sessions mode 'both'; choose one of single, shared, separate"):
        Generator(toy[0], sessions="both")


def test_graph_writes_only_new_rows_in_place(toy) -> None:
    # A marker in the last cache slot (never written: capacity exceeds what the request needs) must
    # survive the whole generation: the graph wrote the new rows into our buffer and copied nothing.
    gen = Generator(toy[0])
    stream = gen.stream(PROMPTS, max_new_tokens=6, greedy=True, capacity=20)
    for event in stream:
        if event.step == 0:
            for layer in range(LAYERS):
                key, value = inspection.read_kv(gen, layer)
                key[:, :, -1], value[:, :, -1] = 7.0, -7.0
                gen.cache.keys[layer].update_inplace(key)
                gen.cache.values[layer].update_inplace(value)
    for layer in range(LAYERS):
        key, value = inspection.read_kv(gen, layer)
        assert (key[:, :, -1] == 7.0).all() and (value[:, :, -1] == -7.0).all()
        for b in range(len(PROMPTS)):
            assert np.abs(key[b, :, : gen.cache.past_lens[b]]).sum(axis=-1).min() > 0  # every filled row written


def test_keep_logits_and_ignore_eos(tmp_path, toy) -> None:
    weights = toy[1]
    eos = reference_greedy(weights, PROMPTS[0], 12)[2]  # a token greedy decoding meets at step 2
    build_export(tmp_path / "eos", eos=eos)
    gen = Generator(tmp_path / "eos")
    result = gen.generate([PROMPTS[0]], max_new_tokens=6, greedy=True, ignore_eos=True, keep_logits=True)
    assert len(result.tokens[0]) == 6 and result.finish_reason == ["length"]
    assert len(result.logits) == 6 and result.logits[0].shape == (1, VOCAB)
    history = list(PROMPTS[0])
    for step, token in enumerate(result.tokens[0]):
        ref, _ = reference_forward(weights, history)
        np.testing.assert_allclose(result.logits[step][0], ref[-1], rtol=1e-4, atol=1e-4)
        history.append(token)
    assert gen.generate([PROMPTS[0]], max_new_tokens=6, greedy=True).logits is None
