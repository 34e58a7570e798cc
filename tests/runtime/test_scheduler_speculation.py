"""Speculation in the continuous-batching Scheduler (runtime/drivers/scheduler_speculation.py): rows drafting by
prompt lookup, by a draft export or not at all in one batch, each with its own draft length; on the `onnx`
target verified together in one call, on the `ort` target each in a one-row call (backend.row_view) beside the
plain rows' decode step. Every greedy answer is checked against the model's own greedy continuation; seeded
sampled answers against a second run. First on the fake backend (tests/fake_backend.py: it refuses what
GroupQueryAttention cannot do), then on real tiny exports with an int4 / fp16 draft export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_backend import FakeModel, make_generator, write_export

from kvforge.core.contract import ModelSpec
from kvforge.core.errors import InputError
from kvforge.core.manifest import load_manifest
from kvforge.runtime import FinishReason, GenerationRequest, Speculation
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.controls.speculate import AdaptiveDraftLength
from kvforge.runtime.drivers.proposers import PromptLookup
from kvforge.runtime.drivers.scheduler import Delta, Scheduler

REPEATING = [[1, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70], [1, 7, 8, 9, 7, 8, 9, 7, 8],
             [5, 17, 99, 3, 42, 17, 99, 3], list(range(20, 41)), [1, 2, 3], [44] * 9]
SPECS = [Speculation("prompt-lookup", 4), Speculation("draft", 3), Speculation("off"), Speculation("draft", 6),
         None, Speculation("prompt-lookup", 2)]


def _request(prompt: list[int], n: int, speculation: Speculation | None = None, **options) -> GenerationRequest:
    options.setdefault("sampling", SamplingConfig(greedy=True))
    return GenerationRequest(prompt, n, ignore_eos=True, speculation=speculation, **options)


# -- the adaptive draft length ---------------------------------------------------------------------
def test_adaptive_draft_length_grows_on_whole_drafts_and_backs_off_on_rejections() -> None:
    length = AdaptiveDraftLength(4, start=2)
    assert [length.update(2, 2), length.update(3, 3), length.update(4, 4), length.update(4, 4)] == [3, 4, 4, 4]
    assert [length.update(4, 1), length.update(3, 0), length.update(2, 0), length.update(1, 0)] == [3, 2, 1, 1]
    assert length.update(0, 0) == 1  # no draft: nothing learnt
    assert length.update(1, 1) == 2
    short = AdaptiveDraftLength(6)  # starts at its most
    assert short.length == 6 and short.update(2, 2) == 6  # a short draft accepted whole says nothing of longer
    for bad in (0, 16, 2.5, True):
        with pytest.raises(ValueError, match="draft_len must be an integer in 1..15"):
            AdaptiveDraftLength(bad)


def test_speculation_off_is_a_request_and_no_method_else() -> None:
    assert Speculation("off").off and not Speculation("draft").off
    request = GenerationRequest.create([1, 2], speculate="off", keep_logits=True)  # off: logits can be kept
    assert request.speculation == Speculation("off")
    with pytest.raises(InputError, match=r"unknown speculation method 'of'.*\(or 'off'\)"):
        Speculation("of")


# -- the fake backend ------------------------------------------------------------------------------
def _draft_model(folder: Path, noise: float) -> FakeModel:
    """The target's fake model with its readout perturbed: it agrees with the target often, not always."""
    vocab = ModelSpec.from_manifest(load_manifest(folder)).vocab_size
    model = FakeModel(vocab)
    model.out = model.out + noise * np.random.default_rng(5).standard_normal(model.out.shape).astype(np.float32)
    return model


def _scheduler(tmp_path: Path, target: str, noise: float = 0.3, **options) -> tuple[FakeModel, Scheduler]:
    folder = write_export(tmp_path / f"target-{target}", target=target)
    generator = make_generator(folder)
    draft = make_generator(write_export(tmp_path / f"draft-{target}", target=target), _draft_model(folder, noise))
    options = {"max_batch": 4, "max_seq_len": 128, "prefill_chunk": 8, **options}
    return generator.backend.model, Scheduler(generator, draft=draft.export, **options)


def _record_wants(scheduler: Scheduler, running: list[int] | None = None,
                  asked: list[tuple[int, int]] | None = None) -> list[dict[int, int]]:
    """Every verification's {batch row: most tokens} as the engine is asked it (and into `running`, how many rows
    were running then; into `asked`, each row's ask beside its request's draft_len)."""
    seen: list[dict[int, int]] = []
    verify = scheduler.engine.verify

    def spy(wants, view=None):
        seen.append({at: most for at, most in wants.items()})
        if running is not None:
            running.append(len(scheduler.engine.running()))
            for at, most in wants.items():  # (asked, the row's own draft_len)
                row = scheduler.engine.rows[at]
                asked.append((most, row.owner.speculation[row.index].speculation.draft_len))
        return verify(wants, view)

    scheduler.engine.verify = spy
    return seen


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_mixed_proposers_in_one_batch_give_plain_greedy(tmp_path: Path, target: str) -> None:
    model, scheduler = _scheduler(tmp_path, target, adaptive=False)
    running: list[int] = []
    asked: list[tuple[int, int]] = []
    wants = _record_wants(scheduler, running, asked)
    handles = [scheduler.submit(_request(p, 30 + i, s)) for i, (p, s) in enumerate(zip(REPEATING, SPECS, strict=True))]
    scheduler.start()
    dones = []
    try:
        for i, (handle, prompt) in enumerate(zip(handles, REPEATING, strict=True)):
            tokens, _, done = handle.result()
            assert tokens == model.greedy(prompt, 30 + i) and done.finish_reason == "length", i
            dones.append(done)
        stats = scheduler.snapshot()
    finally:
        scheduler.close()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # the draft model is wrong at times
    # Each request's Done has its own drafts (the request log's), which make up the totals; none for plain rows.
    assert [done.draft_tokens for done, spec in zip(dones, SPECS, strict=True) if spec is None or spec.off] == [0, 0]
    assert all(0 < d.accepted_tokens <= d.draft_tokens for d, spec in zip(dones, SPECS, strict=True)
               if spec is not None and not spec.off)
    for key in ("draft_tokens", "accepted_tokens"):
        assert sum(getattr(done, key) for done in dones) == stats[key], key
    row_verifications = sum(done.verify_steps for done in dones)  # a call that verifies k rows counts once per row
    assert row_verifications == stats["verify_steps"] if target == "ort" else row_verifications > stats["verify_steps"]
    assert stats["drafted_at"][0] == stats["verify_steps"] if target == "ort" else stats["drafted_at"][0] > 0
    assert stats["drafted_at"][6:] == [0] * 9 and stats["drafted_at"][5] > 0  # the longest draft_len is 6
    assert all(a <= d for a, d in zip(stats["accepted_at"], stats["drafted_at"], strict=True))
    assert stats["speculative_tokens"] > stats["speculative_steps"]  # more than a token per target step
    # Each row asked at most its own request's draft_len (adaptive off: exactly it, until the end is near).
    assert wants and all(most <= own for most, own in asked)
    assert {own for most, own in asked if most == own} == {2, 3, 4, 6}
    assert max(running) == 4  # drafts verified while the batch is full, not only for a request alone
    calls = scheduler.backend.calls
    verifications = [(batch, width) for phase, batch, width in calls if phase == "prefill" and width > 1 and batch > 1]
    if target == "ort":  # GroupQueryAttention: every continuing prefill is one row (the fake refuses more)
        assert all(len(w) == 1 for w in wants) and not verifications
    else:  # several rows verified in one call
        assert any(len(w) > 1 for w in wants) and verifications


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_joining_leaving_cancelled_and_compacted_draft_rows(tmp_path: Path, target: str) -> None:
    """Requests of different lengths join a running batch, finish (their rows are compacted: the draft rows move
    with the target's) and one is cancelled mid-run; the others' tokens are still their plain greedy ones."""
    model, scheduler = _scheduler(tmp_path, target, speculate="draft", draft_len=4)
    moves: list[tuple[int, int]] = []
    compact = scheduler.engine.compact

    def spy() -> list[tuple[int, int]]:
        moves.extend(out := compact())
        return out

    scheduler.engine.compact = spy
    seen: list = []

    def cancel_at_fifth(event) -> None:  # on the scheduler thread: the step it stops at is fixed
        seen.append(event)
        if sum(isinstance(e, Delta) for e in seen) == 5:
            handles[1].cancel()

    lengths = [6, 60, 25, 9, 40, 12]
    specs = [None, None, Speculation("prompt-lookup", 3), Speculation("off"), None, Speculation("draft", 2)]
    handles = [scheduler.submit(_request(REPEATING[0], lengths[0], specs[0])),
               scheduler.submit(_request(REPEATING[1], lengths[1], specs[1]), cancel_at_fifth)]
    handles += [scheduler.submit(_request(REPEATING[i], lengths[i], specs[i])) for i in range(2, 6)]
    scheduler.start()
    try:
        for i, handle in enumerate(handles):
            if i != 1:
                assert handle.result()[0] == model.greedy(REPEATING[i], lengths[i]), i
        late = scheduler.submit(_request(REPEATING[4], 20))  # after the others: rows reused
        assert late.result()[0] == model.greedy(REPEATING[4], 20)
        stats = scheduler.snapshot()
        done = handles[1].done
        tokens = [t for event in seen if isinstance(event, Delta) for t in event.token_ids]
        assert (done.finish_reason, len(tokens)) == (FinishReason.CANCELLED, done.completion_tokens)
        assert tokens == model.greedy(REPEATING[1], 60)[: len(tokens)] and 5 <= len(tokens) < 60
    finally:
        scheduler.close()
    assert moves and stats["verify_steps"] > 0 and stats["running"] == 0
    proposer = scheduler.speculation.draft and scheduler.speculation.proposer("draft")
    assert proposer is not None and not proposer.valid  # every released row's draft state went with it


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_a_perfect_draft_stays_perfect_through_compaction(tmp_path: Path, target: str) -> None:
    """A draft model equal to the target: every draft is kept whole, also after rows finish and the others move
    down (their draft KV rows must move with them, or the moved rows' drafts go wrong)."""
    model, scheduler = _scheduler(tmp_path, target, noise=0.0, speculate="draft", draft_len=3)
    moves: list[tuple[int, int]] = []
    compact = scheduler.engine.compact
    scheduler.engine.compact = lambda: moves.extend(out := compact()) or out
    lengths = [5, 40, 9, 33, 21, 14]
    handles = [scheduler.submit(_request(p, n)) for p, n in zip(REPEATING, lengths, strict=True)]
    scheduler.start()
    try:
        assert [h.result()[0] for h in handles] == [model.greedy(p, n) for p, n in zip(REPEATING, lengths, strict=True)]
        stats = scheduler.snapshot()
    finally:
        scheduler.close()
    assert moves and stats["draft_tokens"] > 50 and stats["accepted_tokens"] == stats["draft_tokens"]


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_seeded_sampled_speculation_repeats(tmp_path: Path, target: str) -> None:
    runs = []
    for attempt in range(2):
        model, scheduler = _scheduler(tmp_path / str(attempt), target)
        sampled = [SamplingConfig(greedy=False, temperature=0.8, seed=11 + i) for i in range(4)]
        specs = [Speculation("draft", 4), Speculation("prompt-lookup", 3), None, Speculation("draft", 2)]
        handles = [scheduler.submit(_request(p, 24, s, sampling=c))
                   for p, s, c in zip(REPEATING, specs, sampled, strict=False)]
        scheduler.start()
        try:
            runs.append([h.result()[0] for h in handles])
            assert scheduler.snapshot()["draft_tokens"] > 0
        finally:
            scheduler.close()
    assert runs[0] == runs[1]
    assert runs[0] != [model.greedy(p, 24) for p in REPEATING[:4]]  # sampled, not greedy


def test_adaptive_lengths_back_off_on_a_bad_draft(tmp_path: Path) -> None:
    model, scheduler = _scheduler(tmp_path, "onnx", noise=50.0, speculate="draft", draft_len=6)
    wants = _record_wants(scheduler)
    scheduler.start()
    try:
        assert scheduler.submit(_request(REPEATING[3], 30)).result()[0] == model.greedy(REPEATING[3], 30)
    finally:
        scheduler.close()
    assert wants[0] == {0: 6} and min(w[0] for w in wants) == 1  # a draft of noise: down to one token


class _HiddenLookup(PromptLookup):
    """A head-like proposer (method "mtp"): drafts by prompt lookup, but reads the target's hidden states and checks
    them. The fake backend's hidden state of position p is the layer-0 value it wrote there, so each observed span
    must equal the row's own cache at those positions."""

    method = "mtp"
    needs_hidden = True

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.spans: list[tuple[int, int]] = []

    def observe(self, engine, kept, hidden) -> None:
        for at, (first, count) in kept.items():
            want = engine.slot.cache.layers[0][1][at, 0, first: first + count]
            if hidden is None or not np.array_equal(hidden[at, :count], want):
                self.errors.append(f"row {at} positions {first}..{first + count - 1}")
            self.spans.append((first, count))


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_head_rows_get_the_hidden_states_of_their_positions(tmp_path: Path, target: str) -> None:
    """A head's rows are given the target's hidden states of every prompt position (chunk after chunk, no reused
    prefix: a prefix store entry has none), of each verification's kept positions (on `ort` from a one-row view)
    and of each decode step, beside prompt-lookup and plain rows."""
    generator = make_generator(write_export(tmp_path / "export", target=target))
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=4)
    head = scheduler.speculation._proposers["mtp"] = _HiddenLookup()
    model = generator.backend.model
    specs = [Speculation("mtp", 3), None, Speculation("prompt-lookup", 3), Speculation("mtp", 2), Speculation("mtp")]
    prompts = [*REPEATING[:4], REPEATING[0]]  # the last: its prefix is in the store by then, and not used
    handles = [scheduler.submit(_request(p, 20, s)) for p, s in zip(prompts, specs, strict=True)]
    scheduler.start()
    try:
        assert [h.result()[0] for h in handles] == [model.greedy(p, 20) for p in prompts]
        stats = scheduler.snapshot()
    finally:
        scheduler.close()
    assert not head.errors and stats["verify_steps"] > 0 and stats["cached_tokens"] == 0
    prompt_spans = [(first, count) for first, count in head.spans if count > 1 and first == 0]
    assert sorted(count for _, count in prompt_spans) == sorted(len(prompts[i]) for i in (0, 3, 4))
    assert any(first > 0 and count > 1 for first, count in head.spans)  # verifications that kept drafts


def test_a_scheduler_default_and_its_refusals(tmp_path: Path) -> None:
    folder = write_export(tmp_path / "export")
    generator = make_generator(folder)
    with pytest.raises(InputError, match="speculation method 'draft' needs a draft export"):
        Scheduler(generator, max_batch=2, speculate="draft")
    with pytest.raises(InputError, match="unknown speculation method 'medusa'"):
        Scheduler(generator, max_batch=2, speculate="medusa")
    with pytest.raises(InputError, match="draft_len must be an integer in 1..15, got 0"):
        Scheduler(generator, max_batch=2, speculate="prompt-lookup", draft_len=0)
    with pytest.raises(InputError, match="adaptive must be true or false"):
        Scheduler(generator, max_batch=2, adaptive="yes")
    scheduler = Scheduler(generator, max_batch=2, max_seq_len=128)
    with pytest.raises(InputError, match="needs a draft export"):
        scheduler.submit(_request([1, 2, 3], 4, Speculation("draft")))
    with pytest.raises(Exception, match="speculation head|head proposer|draft.onnx|speculation method 'eagle'"):
        scheduler.submit(_request([1, 2, 3], 4, Speculation("eagle")))
    scheduler.close()
    # A default applies to requests that name none; "off" opts out.
    scheduler = Scheduler(generator, max_batch=2, max_seq_len=128, speculate="prompt-lookup", draft_len=4).start()
    try:
        model = generator.backend.model
        assert scheduler.submit(_request(REPEATING[0], 30, Speculation("off"))).result()[0] == \
            model.greedy(REPEATING[0], 30)
        assert scheduler.snapshot()["verify_steps"] == 0
        assert scheduler.submit(_request(REPEATING[0], 30)).result()[0] == model.greedy(REPEATING[0], 30)
        assert scheduler.snapshot()["verify_steps"] > 0
    finally:
        scheduler.close()


# -- real tiny exports -------------------------------------------------------------------------------
REAL_PROMPTS = [[1, 17, 230, 41, 9, 77, 12, 17, 230, 41], [1, 5, 6], [1, 300, 2, 301, 44, 45, 46, 47, 48, 49, 50],
                [1, 90, 91, 92, 90, 91, 92, 90], [1, 12, 13], [1, 200, 201, 202, 203, 204]]
REAL_SPECS = [Speculation("prompt-lookup", 4), Speculation("draft", 3), None, Speculation("draft", 5),
              Speculation("prompt-lookup", 2), Speculation("draft", 4)]


@pytest.fixture(scope="module")
def real_pair(exported, draft_export):
    """real_pair(target) -> a Generator on llama-tiny's export with its draft: the same model's int4 export (`ort`)
    or fp16 export (`onnx`) (conftest's draft_export, made once per run), one Generator per module."""
    pytest.importorskip("torch")
    from kvforge.runtime import Generator

    made = {}

    def get(target: str):
        if target not in made:
            made[target] = Generator(exported("llama-tiny", target), draft=draft_export(target))
        return made[target]

    return get


def test_ort_row_view_runs_one_row_in_place(real_pair) -> None:
    backend = real_pair("ort").backend
    slot = backend.allocate(3, 64)
    prompts = np.array([REAL_PROMPTS[0][:6], REAL_PROMPTS[2][:6], REAL_PROMPTS[5]], dtype=np.int64)
    backend.prefill(slot, prompts, np.full(3, 5, dtype=np.int64))
    slot.cache.past_lens[:] = 6
    others = [backend.read_rows(slot, at, 6) for at in (0, 2)]
    view = backend.row_view(slot, 1)
    assert view.cache.batch == 1 and view.cache.row_offset == 1
    assert np.shares_memory(view.cache.past_lens, slot.cache.past_lens)
    extra = np.array([[7, 8, 9]], dtype=np.int64)
    got = backend.prefill(view, extra, np.array([[0, 1, 2]], dtype=np.int64)).copy()
    solo = backend.allocate(1, 64)
    want = backend.prefill(solo, np.concatenate([prompts[1:2], extra], axis=1), np.array([[6, 7, 8]], dtype=np.int64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    view.cache.past_lens[0] += 3
    assert slot.cache.past_lens.tolist() == [6, 9, 6]
    for at, before in zip((0, 2), others, strict=True):  # the other rows untouched, bit for bit
        for layer, old in zip(backend.read_rows(slot, at, 6), before, strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(layer, old, strict=True))
    # the written row is the solo run's row
    for mine, theirs in zip(backend.read_rows(slot, 1, 9), backend.read_rows(solo, 0, 9), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_real_exports_mixed_rows_give_solo_greedy(real_pair, target: str) -> None:
    """Six requests on four rows (joining as rows free up, one cancelled mid-run, rows compacted with their draft
    rows), drafting by prompt lookup, by the draft export, or not at all: each answer is its solo plain greedy one."""
    generator = real_pair(target)
    lengths = [28, 30, 20, 26, 40, 24]
    plain = [generator.generate([p], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]
             for p, n in zip(REAL_PROMPTS, lengths, strict=True)]
    scheduler = Scheduler(generator, max_batch=4, max_seq_len=128, prefill_chunk=8)
    seen: list = []

    def cancel_at_fourth(event) -> None:
        seen.append(event)
        if sum(isinstance(e, Delta) for e in seen) == 4:
            handles[4].cancel()

    handles = [scheduler.submit(_request(p, n, s), cancel_at_fourth if i == 4 else None)
               for i, (p, n, s) in enumerate(zip(REAL_PROMPTS, lengths, REAL_SPECS, strict=True))]
    scheduler.start()
    try:
        for i, handle in enumerate(handles):
            if i != 4:
                assert handle.result()[0] == plain[i], i
        stats = scheduler.snapshot()
        tokens = [t for event in seen if isinstance(event, Delta) for t in event.token_ids]
        assert handles[4].done.finish_reason == FinishReason.CANCELLED and tokens == plain[4][: len(tokens)]
    finally:
        scheduler.close()
    assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"] and stats["verify_steps"] > 0
    assert stats["speculative_tokens"] > stats["speculative_steps"]


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_real_exports_seeded_sampled_speculation_repeats(real_pair, target: str) -> None:
    generator = real_pair(target)
    runs = []
    for _ in range(2):
        scheduler = Scheduler(generator, max_batch=4, max_seq_len=128, prefill_chunk=8).start()
        try:
            handles = [scheduler.submit(_request(p, 16, s, sampling=SamplingConfig(greedy=False, temperature=0.9,
                                                                                    seed=3 + i)))
                       for i, (p, s) in enumerate(zip(REAL_PROMPTS[:4], REAL_SPECS[:4], strict=True))]
            runs.append([h.result()[0] for h in handles])
            assert scheduler.snapshot()["draft_tokens"] > 0
        finally:
            scheduler.close()
    assert runs[0] == runs[1]



def test_device_path_row_views_verify_beside_the_batch(exported, monkeypatch) -> None:
    """ort-cuda's code path on the CPU (tests/runtime/test_device_path.py): a one-row view is bound by address (the
    buffer's plus the row's offset); speculative rows verified on it beside a running batch give the ort-cpu
    tokens."""
    from test_device_path import HostCudart, SimulatedDevice

    from kvforge.core import cuda
    from kvforge.runtime import Generator

    fake = HostCudart()
    monkeypatch.setattr(cuda, "_cudart", lambda: fake)
    folder = exported("llama-tiny", "ort")
    cpu, device = Generator(folder), Generator(folder, backend=SimulatedDevice(folder, load_manifest(folder)))
    lengths = [20, 24, 16, 22]
    plain = [cpu.generate([p], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]
             for p, n in zip(REAL_PROMPTS, lengths, strict=False)]
    scheduler = Scheduler(device, max_batch=4, max_seq_len=96, prefill_chunk=8, speculate="prompt-lookup",
                          draft_len=3)
    running: list[int] = []
    _record_wants(scheduler, running, [])
    handles = [scheduler.submit(_request(p, n)) for p, n in zip(REAL_PROMPTS, lengths, strict=False)]
    scheduler.start()
    try:
        assert [h.result()[0] for h in handles] == plain
    finally:
        scheduler.close()
    assert max(running) > 1 and scheduler.snapshot()["draft_tokens"] > 0
    base = scheduler.slot.cache.buffer_pointers()
    views = scheduler.speculation._views
    assert views and all(view.cache.on_device and not view.cache.buffer_values for view in views.values())
    row_bytes = [int(np.prod(shape[1:])) * dtype.itemsize
                 for shape, dtype in zip(scheduler.slot.cache.buffer_shapes(), scheduler.slot.cache.host_dtypes,
                                         strict=True)]
    for at, view in views.items():  # bound at the row's own address in every buffer
        assert view.cache.buffer_pointers() == [p + at * n for p, n in zip(base, row_bytes, strict=True)]
