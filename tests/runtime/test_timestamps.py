"""Whisper's timestamp rules in numpy (runtime/drivers/timestamps.py) against transformers' own processor, and the
timed segments they give."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvforge.runtime.drivers.timestamps import TimestampRules, segments

torch = pytest.importorskip("torch")

VOCAB, NO_TIMESTAMPS, EOS, BEGIN = 400, 300, 250, 3


def test_the_rules_equal_transformers_whisper_timestamp_processor():
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    config = SimpleNamespace(no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS, bos_token_id=EOS,
                             max_initial_timestamp_index=5)
    theirs = WhisperTimeStampLogitsProcessor(config, begin_index=BEGIN)
    ours = TimestampRules(NO_TIMESTAMPS, EOS, BEGIN, max_initial=5)
    rng = np.random.default_rng(0)
    lowest, masked = np.finfo(np.float32).min, []
    for trial in range(300):
        steps = int(rng.integers(0, 6))
        if trial % 3 == 0:  # timestamps in a row, not decreasing
            history = [[1, 2, 3] + sorted(int(t) for t in rng.integers(301, VOCAB, size=steps)) for _ in range(4)]
        else:  # text and timestamps mixed
            history = [[1, 2, 3] + [int(rng.integers(0, 250)) if rng.random() < 0.5 else int(rng.integers(301, VOCAB))
                                    for _ in range(steps)] for _ in range(4)]
        logits = (rng.standard_normal((4, VOCAB)) * 3).astype(np.float32)
        logits[:, NO_TIMESTAMPS + 1:] += rng.normal(0, 2)  # the timestamps' mass sometimes beats the text
        expected = theirs(torch.tensor(history), torch.from_numpy(logits.copy())).numpy()
        got = ours.apply(logits.copy(), steps, history)
        banned = np.isinf(expected)
        np.testing.assert_array_equal(got <= lowest, banned)
        np.testing.assert_array_equal(got[~banned], expected[~banned])
        masked.append(banned[:, :NO_TIMESTAMPS].all(axis=-1).mean())
    assert 0 < np.mean(masked) < 1  # both ways of the probability-mass rule were exercised


def test_segments_pair_the_timestamps_and_offset_them_by_the_window():
    first = NO_TIMESTAMPS + 1
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    tokens = [first + 0, 5, 6, first + 100, first + 100, 7, first + 150, first + 150, 8, EOS, 9]
    assert segments(tokens, first, 30.0, EOS, decode) == [
        {"start": 30.0, "end": 32.0, "text": "5 6", "tokens": [5, 6]},
        {"start": 32.0, "end": 33.0, "text": "7", "tokens": [7]},
        {"start": 33.0, "end": 33.0, "text": "8", "tokens": [8]},  # opened, never closed: no end time
    ]
    assert segments([5, 6], first, 0.0, EOS, decode) == [{"start": 0.0, "end": 0.0, "text": "5 6", "tokens": [5, 6]}]
