"""Continuous batching of encoder-decoder rows (runtime/drivers/seq2seq_batch.py): requests from many threads, of
different encoder lengths and token limits, joining while others decode, each equal to the generator alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from seq2seq_testing import seq2seq_export

from kvforge.core.errors import InputError, KvforgeError, QueueFullError

pytest.importorskip("torch")
STEPS = 20


@pytest.fixture(scope="module")
def mbart(tmp_path_factory):
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator

    generator = Seq2SeqGenerator(seq2seq_export(tmp_path_factory, "mbart") / "export", threads=1)
    rng = np.random.default_rng(0)
    eos = generator.rules.eos[0]
    sources = [[*rng.integers(5, 90, n).tolist(), eos] for n in (3, 11, 7, 20, 5, 9, 14, 2, 6, 17)]
    return generator, sources


@pytest.mark.xdist_group("seq2seq")
def test_concurrent_rows_of_different_lengths_equal_each_alone(mbart, monkeypatch):
    from kvforge.runtime.drivers.seq2seq_batch import Seq2SeqBatcher

    generator, sources = mbart
    limits = [STEPS - i for i in range(len(sources))]  # rows leave at different steps
    alone = [generator.generate_ids(generator.encode_ids([s]), n)[0] for s, n in zip(sources, limits, strict=True)]
    batcher = Seq2SeqBatcher(generator, max_rows=4)
    widths = []  # the rows of each decode run: batching must happen (else this would pass serialised)
    decode, step = batcher._decode, batcher._step
    monkeypatch.setattr(batcher, "_decode", lambda count: (widths.append(count), decode(count)))
    # The decoding thread's first step waits until every request is queued, so that rows must wait for slots and
    # join while others decode, whatever the machine's timing.
    first: list[int] = []
    opened = threading.Event()

    def gated(admitted):
        if not first:
            first.append(len(admitted))
            opened.wait(timeout=60)
        return step(admitted)

    monkeypatch.setattr(batcher, "_step", gated)
    got: list = [None] * len(sources)

    def call(i: int) -> None:
        got[i] = batcher.generate_ids(generator.encode_ids([sources[i]]), limits[i])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(sources))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while (not first or len(batcher.waiting) < len(sources) - first[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    opened.set()
    for thread in threads:
        thread.join()
    assert got == alone
    assert max(widths) == 4 and min(widths) < 4
    several = batcher.generate_ids(generator.encode_ids(sources[:3]), STEPS)  # one caller, several rows
    assert several == [generator.generate_ids(generator.encode_ids([s]), STEPS)[0] for s in sources[:3]]
    batcher.close()
    with pytest.raises(KvforgeError, match="batcher is closed"):
        batcher.generate_ids(generator.encode_ids(sources[:1]), 4)


@pytest.mark.xdist_group("seq2seq")
def test_a_whisper_window_with_timestamp_rules_decodes_as_alone(tmp_path_factory):
    """Each row keeps its own rules (Whisper's timestamp rules from its prompt's end) and sampler (a seed)."""
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.runtime.drivers.seq2seq_batch import Seq2SeqBatcher
    from kvforge.runtime.drivers.transcribe import Transcriber

    generator = Seq2SeqGenerator(seq2seq_export(tmp_path_factory, "whisper") / "export", threads=1)
    batcher = Seq2SeqBatcher(generator, max_rows=2)
    rng = np.random.default_rng(1)
    samples = [(0.1 * rng.standard_normal(16000 * seconds)).astype(np.float32) for seconds in (5, 12, 20)]
    plain, batched = Transcriber(generator), Transcriber(generator, batcher)
    sampled = SamplingConfig(greedy=False, temperature=1.0, seed=3)
    results: dict = {}

    def call(i: int) -> None:
        results[i] = batched.transcribe(samples[i], rate=16000, language="en", max_new_tokens=16,
                                        timestamps=i != 1, sampling=sampled if i == 2 else None)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(3):
        expected = plain.transcribe(samples[i], rate=16000, language="en", max_new_tokens=16, timestamps=i != 1,
                                    sampling=sampled if i == 2 else None)
        assert results[i].windows == expected.windows
    batcher.close()


def test_a_full_queue_and_bad_settings_are_refused(mbart):
    from kvforge.runtime.drivers.seq2seq_batch import Seq2SeqBatcher

    generator, sources = mbart
    with pytest.raises(InputError, match=r"^max_rows must be a positive integer, got 0$"):
        Seq2SeqBatcher(generator, max_rows=0)
    batcher = Seq2SeqBatcher(generator, max_rows=1, max_queue=2)
    with pytest.raises(QueueFullError, match=r"rows are already waiting \(max_queue 2\)"):
        batcher.generate_ids(generator.encode_ids(sources[:3]), 4)
    with pytest.raises(InputError, match=r"^max_new_tokens must be 1\.\."):
        batcher.generate_ids(generator.encode_ids(sources[:1]), 0)
    assert batcher.generate_ids(generator.encode_ids(sources[:2]), 4) == generator.generate_ids(
        generator.encode_ids(sources[:2]), 4)
    batcher.close()
