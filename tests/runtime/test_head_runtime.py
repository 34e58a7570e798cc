"""The runtime side of speculation heads (draft.onnx): the target's hidden states from the OrtBackend, the head
runner over its own KV cache, and the HeadProposer; on a hand-built head (tests/runtime/head_fixture.py, ort and onnx
targets) and on an EAGLE-3 head as the exporter writes it. References recompute from scratch: the ONNX graph run
without a cache over the whole sequence (causal attention: position p depends on inputs 0..p only)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip("torch")

from head_fixture import DT, H, Reference, TinyHead, V, fresh, make_head_export, session  # noqa: E402

from kvforge.core.contract import TARGET_HIDDEN  # noqa: E402
from kvforge.core.errors import BackendUnavailableError, CapacityError, ManifestError  # noqa: E402
from kvforge.runtime.backends.backend import create_backend  # noqa: E402
from kvforge.runtime.backends.head_runner import HeadRunner  # noqa: E402
from kvforge.runtime.backends.ort_backend import OrtBackend  # noqa: E402
from kvforge.runtime.backends.target_hidden import refuse_heads  # noqa: E402
from kvforge.runtime.controls.acceptance import target_distribution  # noqa: E402
from kvforge.runtime.controls.request import GenerationRequest, Stopper  # noqa: E402
from kvforge.runtime.controls.sampling import SamplingConfig  # noqa: E402
from kvforge.runtime.drivers.head_proposer import HeadProposer, open_head  # noqa: E402
from kvforge.runtime.drivers.rows import Picker, Row  # noqa: E402

TOL = 2e-4  # float32, a KV-cached run against a recompute (different summation order only)


@pytest.fixture(scope="module", params=["ort", "onnx"])
def head_export(request, exported, tmp_path_factory) -> tuple[Path, dict]:
    return make_head_export(exported("llama-tiny", request.param),
                            tmp_path_factory.mktemp(f"head-{request.param}") / "export", request.param)


# -- the target's hidden states ----------------------------------------------------------------------
class SimulatedDevice(OrtBackend):
    simulate_device = True  # ort-cuda's code path on ONNX Runtime CPU (tests/runtime/test_device_path.py)


@pytest.mark.parametrize("sessions", ["single", "separate", "device"])
def test_target_hidden_is_what_the_graph_outputs(head_export, sessions):
    """ort-cpu's session modes, and the device path (a decode step's hidden states in a device buffer)."""
    folder, manifest = head_export
    backend = SimulatedDevice(folder, manifest, threads=1) if sessions == "device" else \
        create_backend("ort-cpu", folder, manifest, threads=1, sessions=sessions)
    slot = backend.allocate(2, 64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, V, 9), rng.integers(3, V, 6)]
    ids = np.zeros((2, 9), np.int64)
    for b, prompt in enumerate(prompts):
        ids[b, :len(prompt)] = prompt
    backend.prefill(slot, ids, np.array([8, 5]))
    got = backend.target_hidden(slot).copy()
    assert got.shape == (2, 9, DT)
    prefill = session(folder, manifest["graphs"]["prefill"]["file"])
    for b, prompt in enumerate(prompts):
        want = _full_prefill(prefill, manifest, prompt)
        np.testing.assert_allclose(got[b, :len(prompt)], want, atol=TOL)
    slot.cache.past_lens[:] = [9, 6]
    nxt = np.array([7, 11])
    backend.decode(slot, nxt)
    step = backend.target_hidden(slot)
    assert step.shape == (2, 1, DT)
    assert (slot.hidden_state.device is not None) == (sessions == "device")
    for b, prompt in enumerate(prompts):
        want = _full_prefill(prefill, manifest, [*prompt, nxt[b]])
        np.testing.assert_allclose(step[b, 0], want[-1], atol=TOL)


def _full_prefill(session: ort.InferenceSession, manifest: dict, tokens) -> np.ndarray:
    layers, heads, dim = (manifest["kv_cache"][k] for k in ("num_layers", "num_kv_heads", "head_dim"))
    feeds = {"input_ids": np.asarray(tokens, np.int64)[None], "past_lens": np.zeros(1, np.int32),
             "logits_index": np.array([[len(tokens) - 1]], np.int64)}
    for layer in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{layer}"] = np.zeros((1, heads, len(tokens), dim), np.float32)
    return session.run([TARGET_HIDDEN], feeds)[0][0]


def test_backends_without_heads_refuse(head_export, exported):
    from kvforge.runtime.backends.trt_backend import TrtBackend

    for name in ("emulate", "tensorrt"):
        with pytest.raises(BackendUnavailableError, match=f"backend '{name}' does not run speculation heads"):
            refuse_heads(SimpleNamespace(name=name))
    with pytest.raises(BackendUnavailableError, match="'tensorrt' does not run speculation heads"):
        TrtBackend.target_hidden(SimpleNamespace(name="tensorrt"), None)
    plain = exported("llama-tiny", "ort")
    backend = create_backend("ort-cpu", plain, json.loads((plain / "kvforge.json").read_text()), threads=1)
    slot = backend.allocate(1, 64)
    backend.prefill(slot, np.array([[5, 6, 7]]), np.array([2]))
    with pytest.raises(ManifestError, match="output no target_hidden"):
        backend.target_hidden(slot)
    with pytest.raises(BackendUnavailableError, match="'emulate'"):
        open_head(head_export[0], head_export[1], SimpleNamespace(name="emulate"))


# -- the head runner ---------------------------------------------------------------------------------
def _inputs(rng, seq):
    return rng.integers(3, V, seq), rng.standard_normal((seq, DT)).astype(np.float32)


def test_runner_catch_up_and_chain_equal_a_recompute(head_export):
    folder, manifest = head_export
    runner = HeadRunner(folder, manifest, threads=1)
    graph = session(folder, "draft.onnx")
    np.testing.assert_array_equal(runner.token_map, TinyHead().tmap.numpy())
    slot = runner.allocate(2, 32)
    rng = np.random.default_rng(5)
    lens = [7, 4]
    seqs = [list(_inputs(rng, n)) for n in lens]  # per row: (ids, target hidden)
    ids = np.zeros((2, 7), np.int64)
    target = np.zeros((2, 7, DT), np.float32)
    for b, (tokens, states) in enumerate(seqs):
        ids[b, :lens[b]], target[b, :lens[b]] = tokens, states
    logits, hidden = runner.run(slot, ids, target, np.zeros((2, 7, H)), np.zeros(2))
    own = [hidden[b, lens[b] - 1].copy() for b in range(2)]
    chained = [[(tokens[:], states[:], np.zeros((n, H)))] for (tokens, states), n in zip(seqs, lens, strict=True)]
    for b in range(2):
        want_logits, want_hidden = fresh(graph, seqs[b][0], seqs[b][1], np.zeros((lens[b], H)))
        np.testing.assert_allclose(logits[b, :lens[b]], want_logits, atol=TOL)
        np.testing.assert_allclose(hidden[b, :lens[b]], want_hidden, atol=TOL)
    past = np.array(lens)
    for step in range(3):  # chained positions: the drafted token, zeros for target_hidden, the previous hidden_out
        tokens = rng.integers(3, V, 2)
        logits, hidden = runner.run(slot, tokens[:, None], np.zeros((2, 1, DT)), np.stack(own)[:, None], past)
        for b in range(2):
            ids_b, target_b, draft_b = chained[b][-1]
            ids_b = np.append(ids_b, tokens[b])
            target_b, draft_b = np.vstack([target_b, np.zeros((1, DT))]), np.vstack([draft_b, own[b][None]])
            chained[b].append((ids_b, target_b, draft_b))
            want_logits, want_hidden = fresh(graph, ids_b, target_b, draft_b)
            np.testing.assert_allclose(logits[b, 0], want_logits[-1], atol=TOL, err_msg=f"step {step} row {b}")
            np.testing.assert_allclose(hidden[b, 0], want_hidden[-1], atol=TOL)
            own[b] = hidden[b, 0].copy()
        past += 1
    with pytest.raises(CapacityError, match="needs 33 positions but the head's cache holds 32"):
        runner.run(slot, np.zeros((1, 2)), np.zeros((1, 2, DT)), np.zeros((1, 2, H)), np.array([31]))


def test_runner_rollback_copy_and_move_rows(head_export):
    folder, manifest = head_export
    runner = HeadRunner(folder, manifest, threads=1)
    graph = session(folder, "draft.onnx")
    slot = runner.allocate(3, 32)
    rng = np.random.default_rng(9)
    tokens, states = _inputs(rng, 8)
    runner.run(slot, tokens[None], states[None], np.zeros((1, 8, H)), np.zeros(1))
    # Chained positions 8..10 are written, then rolled back: a catch-up of new positions from 5 rewrites them.
    runner.run(slot, np.array([[4], [5]]).T, np.zeros((1, 2, DT)), rng.standard_normal((1, 2, H)), np.array([8]))
    new_tokens, new_states = _inputs(rng, 4)
    logits, hidden = runner.run(slot, new_tokens[None], new_states[None], np.zeros((1, 4, H)), np.array([5]))
    all_tokens, all_states = np.concatenate([tokens[:5], new_tokens]), np.concatenate([states[:5], new_states])
    want_logits, want_hidden = fresh(graph, all_tokens, all_states, np.zeros((9, H)))
    np.testing.assert_allclose(logits[0], want_logits[5:], atol=TOL)
    np.testing.assert_allclose(hidden[0], want_hidden[5:], atol=TOL)
    # Row 0's 9 positions copied to row 2 (the scheduler's moves): the same next position on either row.
    runner.copy_rows(slot, 0, slot, 2, 9)
    step = rng.integers(3, V, 1), rng.standard_normal((1, 1, H)).astype(np.float32)
    one = runner.run(slot, step[0][None], np.zeros((1, 1, DT)), step[1], np.array([9]), first=0)
    two = runner.run(slot, step[0][None], np.zeros((1, 1, DT)), step[1], np.array([9]), first=2)
    np.testing.assert_array_equal(one[0], two[0])
    want = fresh(graph, np.append(all_tokens, step[0]), np.vstack([all_states, np.zeros((1, DT))]),
                  np.vstack([np.zeros((9, H)), step[1][0]]))
    np.testing.assert_allclose(two[0][0, 0], want[0][-1], atol=TOL)


# -- the proposer ------------------------------------------------------------------------------------
def _row(prompt, index: int = 0) -> Row:
    return Row(list(prompt), Stopper(GenerationRequest(list(prompt), 64, ignore_eos=True), frozenset(), None),
               index=index)


def _engine(batch: int, capacity: int) -> SimpleNamespace:
    from kvforge.runtime.drivers.engine import StepEngine

    cache = SimpleNamespace(batch=batch, capacity=capacity)
    engine = SimpleNamespace(rows=[None] * batch, pickers=[None] * batch, slot=SimpleNamespace(cache=cache))
    engine.rng_of = lambda at: StepEngine.rng_of(engine, at)  # the engine's own rule: a row's random stream
    return engine


GREEDY = SamplingConfig()


def _place(engine, at: int, row: Row, config: SamplingConfig = GREEDY) -> None:
    engine.rows[at], engine.pickers[at] = row, Picker(config)


def test_proposer_drafts_equal_a_recompute_through_verifications(head_export):
    folder, manifest = head_export
    proposer = HeadProposer(HeadRunner(folder, manifest, threads=1))
    assert (proposer.method, proposer.needs_hidden) == ("mtp", True)
    ref = Reference(session(folder, "draft.onnx"), proposer.runner.token_map)
    rng = np.random.default_rng(11)
    engine = _engine(4, 40)
    sampling = SamplingConfig(greedy=False, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    lens = {0: 9, 1: 7, 2: 5}
    for at, n in lens.items():
        _place(engine, at, _row(rng.integers(3, V, n), index=at), sampling if at == 2 else SamplingConfig())
    seen = {at: rng.standard_normal((n, DT)).astype(np.float32) for at, n in lens.items()}
    prefill = np.zeros((4, 9, DT), np.float32)
    for at, states in seen.items():
        prefill[at, :len(states)] = states
        engine.rows[at].tokens.append(int(rng.integers(3, V)))  # the prefill's token, accepted before observe
    proposer.observe(engine, {at: (0, n) for at, n in lens.items()}, prefill)

    drafts = proposer.propose(engine, {0: 4, 2: 3})  # row 1 sits idle inside the block of rows 0..2
    assert sorted(drafts) == [0, 2]
    want, _ = ref.drafts(engine.rows[0], seen[0], k=4)
    np.testing.assert_array_equal(drafts[0].tokens, want)
    assert drafts[0].probs is None
    _check_sampled(ref, engine.rows[2], seen[2], drafts[2], sampling, proposer.runner.token_map)

    # Verification: row 0 keeps 2 drafts and the target's next token, row 2 none (a replacement), row 1 decodes.
    kept = {0: (9, 3), 1: (7, 1), 2: (5, 1)}
    step = np.zeros((4, 3, DT), np.float32)
    for at, (_, count) in kept.items():
        step[at, :count] = rng.standard_normal((count, DT))
        seen[at] = np.concatenate([seen[at], step[at, :count]])
    engine.rows[0].tokens += [*drafts[0].tokens[:2].tolist(), 17]
    engine.rows[1].tokens.append(23)
    engine.rows[2].tokens.append(29)
    proposer.observe(engine, kept, step)
    drafts = proposer.propose(engine, {0: 3, 1: 2, 2: 2})
    for at, k in ((0, 3), (1, 2)):
        np.testing.assert_array_equal(drafts[at].tokens, ref.drafts(engine.rows[at], seen[at], k=k)[0])
    _check_sampled(ref, engine.rows[2], seen[2], drafts[2], sampling, proposer.runner.token_map)

    # Compaction moves row 0 to row 3 (its head rows with it); row 1 leaves.
    proposer.release(1)
    engine.rows[1] = None
    proposer.move(0, 3)
    engine.rows[3], engine.pickers[3], engine.rows[0] = engine.rows[0], engine.pickers[0], None
    engine.rows[3].tokens.append(31)
    extra = rng.standard_normal((1, 1, DT)).astype(np.float32)
    held = np.zeros((4, 1, DT), np.float32)
    held[3] = extra[0]
    proposer.observe(engine, {3: (12, 1)}, held)
    seen[0] = np.concatenate([seen[0], extra[0]])
    drafts = proposer.propose(engine, {3: 2})
    np.testing.assert_array_equal(drafts[3].tokens, ref.drafts(engine.rows[3], seen[0], k=2)[0])


def _check_sampled(ref, row, hidden, draft, config, token_map) -> None:
    """A sampled draft: each token drawn from the head's distribution under the row's settings, returned over the
    target vocabulary (zero outside token_map)."""
    tokens, logits = ref.drafts(row, hidden, forced=draft.tokens)
    assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), V)
    for j, seen in enumerate(logits):
        want = np.zeros(V)
        want[token_map] = target_distribution(seen, config)
        np.testing.assert_allclose(draft.probs[j], want, atol=1e-5)
        assert draft.probs[j, draft.tokens[j]] > 0
    outside = np.setdiff1d(np.arange(V), token_map)
    assert not draft.probs[:, outside].any()
    np.testing.assert_allclose(draft.probs.sum(-1), 1.0, atol=1e-9)


def test_sampled_drafts_repeat_with_their_seed(head_export):
    folder, manifest = head_export
    runner = HeadRunner(folder, manifest, threads=1)
    config = SamplingConfig(greedy=False, temperature=1.3, seed=3)
    rng = np.random.default_rng(2)
    prompt, hidden = rng.integers(3, V, 6), rng.standard_normal((1, 6, DT)).astype(np.float32)
    runs = []
    for _ in range(2):
        engine, proposer = _engine(1, 32), HeadProposer(runner)
        _place(engine, 0, _row(prompt), config)
        engine.rows[0].tokens.append(5)
        proposer.observe(engine, {0: (0, 6)}, hidden)
        runs.append(proposer.propose(engine, {0: 6})[0])
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    np.testing.assert_array_equal(runs[0].probs, runs[1].probs)


def test_a_full_row_beside_a_catch_up_splits_it(head_export):
    """A row whose cache is full sits between two rows that catch up: each call of the block goes one position
    (the head cache's spare one holds the full row's padding), and the drafts still equal the recompute."""
    folder, manifest = head_export
    proposer = HeadProposer(HeadRunner(folder, manifest, threads=1))
    ref = Reference(session(folder, "draft.onnx"), proposer.runner.token_map)
    rng = np.random.default_rng(4)
    engine = _engine(3, 12)
    rows = {0: _row(rng.integers(3, V, 5)), 1: _row(rng.integers(3, V, 12)), 2: _row(rng.integers(3, V, 4))}
    states = rng.standard_normal((3, 12, DT)).astype(np.float32)
    _place(engine, 1, rows[1])
    rows[1].tokens.append(9)
    proposer.observe(engine, {1: (0, 12)}, states)
    proposer.propose(engine, {1: 1})
    assert proposer.rows[1].valid == 12
    for at in (0, 2):
        _place(engine, at, rows[at])
        rows[at].tokens.append(8)
    proposer.observe(engine, {0: (0, 5), 2: (0, 4)}, states)
    calls = []
    run = proposer.runner.run
    proposer.runner.run = lambda *args, **kw: calls.append(args[1].shape) or run(*args, **kw)  # type: ignore
    drafts = proposer.propose(engine, {0: 3, 2: 2})
    assert calls == [(3, 1)] * 5 + [(3, 1)] * 2  # five catch-up calls, then two chained positions
    for at, k in ((0, 3), (2, 2)):
        np.testing.assert_array_equal(drafts[at].tokens, ref.drafts(rows[at], states[at, :len(rows[at].prompt)],
                                                                    k=k)[0])


def test_observe_rewinds_and_skips_and_the_cache_follows_the_engine(head_export):
    folder, manifest = head_export
    proposer = HeadProposer(HeadRunner(folder, manifest, threads=1))
    ref = Reference(session(folder, "draft.onnx"), proposer.runner.token_map)
    rng = np.random.default_rng(6)
    engine = _engine(1, 24)
    row = _row(rng.integers(3, V, 12))
    _place(engine, 0, row)
    states = rng.standard_normal((1, 12, DT)).astype(np.float32)
    proposer.observe(engine, {0: (0, 5)}, states)
    proposer.observe(engine, {0: (5, 2)}, states[:, 5:])
    state = proposer.rows[0]
    assert (state.valid, state.waiting) == (0, 7)
    proposer.observe(engine, {0: (3, 4)}, states[:, 3:])  # the target rewound to position 3: what follows is new
    assert (state.valid, state.waiting) == (0, 7)
    np.testing.assert_array_equal(np.concatenate(state.pending), states[0, :7])
    row.tokens.append(4)
    first = proposer.propose(engine, {0: 2})[0]
    assert (state.valid, state.waiting) == (7, 0)
    np.testing.assert_array_equal(first.tokens, ref.drafts(row, states[0, :7], k=2)[0])
    # The engine moves to a larger capacity bucket: the head's rows come along.
    engine.slot.cache.capacity = 48
    proposer.observe(engine, {0: (7, 5)}, states[:, 7:])
    row.tokens += [5, 6]  # the context now holds the token after position 11
    assert proposer.propose(engine, {0: 2})[0].tokens.tolist() == ref.drafts(row, states[0], k=2)[0].tolist()
    assert proposer.slot.cache.capacity == 49
    proposer.observe(engine, {0: (20, 1)}, states)  # positions the head never saw (a reused prefix): skipped
    assert (state.valid, state.waiting) == (20, 1)
    engine.rows[0] = _row([1, 2, 3])  # another row placed at batch row 0 starts afresh
    proposer.observe(engine, {0: (0, 3)}, states)
    assert proposer.rows[0] is not state and proposer.rows[0].waiting == 3


# -- heads as the exporters write them (exporter/draft_head.py, exporter/mtp_head.py) --------------------------
@pytest.fixture(scope="module", params=["eagle", "mtp"])
def real_head(request, eagle_export, mtp_export) -> tuple[Path, str]:
    """eagle: an 8-layer tiny Llama (seeded random weights) with a random speculators-form EAGLE-3 head; mtp: the
    tiny DeepSeek-V3 checkpoint with one MTP layer (models/mtp_fixture.py). Exported for ort, once per run
    (tests/head_exports.py through conftest's fixtures, shared with the exporters' tests)."""
    if request.param == "mtp":
        return mtp_export("deepseek_v3") / "mtp", "mtp"
    return eagle_export("llama-tiny", "ort")[0], "eagle"


def test_an_exported_head_drafts_through_verification(real_head):
    """The exporters' heads and records through the backend's target_hidden and the proposer: prefill, drafts, the
    target's greedy verification in one prefill call, drafts again; each draft equals the recompute."""
    from kvforge.core.manifest import load_manifest

    folder, method = real_head
    manifest = load_manifest(folder)
    backend = create_backend("ort-cpu", folder, manifest, threads=1)
    runner = open_head(folder, manifest, backend, threads=1)
    proposer = HeadProposer(runner)
    vocab = manifest["model"]["vocab_size"]
    assert proposer.method == method and runner.target_width == manifest["draft"]["target_hidden_size"]
    if method == "mtp":
        np.testing.assert_array_equal(runner.token_map, np.arange(vocab))
    ref = Reference(session(folder, "draft.onnx"), runner.token_map, (runner.target_width, runner.width))
    slot, engine = backend.allocate(1, 64), _engine(1, 64)
    prompt = np.random.default_rng(8).integers(3, vocab, 10)
    _place(engine, 0, _row(prompt))
    logits = backend.prefill(slot, prompt[None], np.array([9]))
    seen = backend.target_hidden(slot)[0].copy()
    slot.cache.past_lens[:] = 10
    engine.rows[0].tokens.append(int(logits[0].argmax()))
    proposer.observe(engine, {0: (0, 10)}, seen[None])
    for _ in range(3):
        draft = proposer.propose(engine, {0: 4})[0]
        np.testing.assert_array_equal(draft.tokens, ref.drafts(engine.rows[0], seen, k=4)[0])
        first = int(slot.cache.past_lens[0])
        block = np.array([[engine.rows[0].tokens[-1], *draft.tokens]])
        picked = backend.prefill(slot, block, np.arange(5)[None])[0].argmax(-1)
        n = 0
        while n < 4 and picked[n] == draft.tokens[n]:
            n += 1
        kept = backend.target_hidden(slot)[0, : n + 1].copy()
        engine.rows[0].tokens += [*draft.tokens[:n].tolist(), int(picked[n])]
        slot.cache.past_lens[0] += n + 1
        proposer.observe(engine, {0: (first, n + 1)}, kept[None])
        seen = np.concatenate([seen, kept])
