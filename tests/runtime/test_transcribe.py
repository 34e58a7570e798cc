"""Speech to text (runtime/drivers/transcribe.py, `kvforge transcribe`) with the tiny seeded Whisper (Whisper's id
layout: its task, language and timestamp tokens) against transformers on the same audio.

Up to 30 s (one window) the reference is transformers' generic `generate` after the same task prompt with the
checkpoint's suppress rules (and its timestamp processor when asked): Whisper's own `generate` turns the timestamp
tokens a random model emits into segments. Longer recordings are decoded long-form, and the reference is Whisper's
own `generate` on the whole recording's features, which is what transformers' pipeline calls (greedy: the pipeline's
default for Whisper is 5 beams, and kvforge has no beam search)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from seq2seq_testing import seq2seq_export

from kvforge.core.errors import InputError

torch = pytest.importorskip("torch")
soundfile = pytest.importorskip("soundfile")

RATE = 16000
TOKENS = 12


def _clip(seconds: float, rate: int = RATE) -> np.ndarray:
    rng = np.random.default_rng(3)
    t = np.arange(int(seconds * rate)) / rate
    return (0.1 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.runtime.drivers.transcribe import Transcriber

    folder = seq2seq_export(tmp_path_factory, "whisper")
    return dict(folder=folder, transcriber=Transcriber(Seq2SeqGenerator(folder / "export", threads=1)),
                model=WhisperForConditionalGeneration.from_pretrained(folder / "hf").eval(),
                extractor=WhisperFeatureExtractor.from_pretrained(folder / "hf"))


def _reference(whisper, samples: np.ndarray, prompt: list[int], timestamps: bool = False) -> list[list[int]]:
    from transformers import GenerationMixin
    from transformers.generation.logits_process import LogitsProcessorList, WhisperTimeStampLogitsProcessor

    rows = []
    for start in range(0, samples.size, 30 * RATE):
        features = whisper["extractor"](samples[start: start + 30 * RATE], sampling_rate=RATE,
                                        return_tensors="pt").input_features
        with torch.no_grad():
            processors = LogitsProcessorList([WhisperTimeStampLogitsProcessor(
                whisper["model"].generation_config, begin_index=len(prompt))] if timestamps else [])
            out = GenerationMixin.generate(whisper["model"], input_features=features, max_new_tokens=TOKENS,
                                           decoder_input_ids=torch.tensor([prompt]), do_sample=False, num_beams=1,
                                           logits_processor=processors)
        row = out[0, len(prompt):].tolist()
        eos = whisper["model"].generation_config.eos_token_id
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.mark.xdist_group("seq2seq")
def test_each_window_equals_transformers_after_the_task_prompt(whisper, tmp_path):
    samples = _clip(25.0)  # one window, padded to 30 s
    path = tmp_path / "speech.wav"
    soundfile.write(path, samples, RATE, subtype="FLOAT")
    transcriber = whisper["transcriber"]
    found = transcriber.transcribe(path, language="en", max_new_tokens=TOKENS)
    prompt = transcriber.prompt("en", "transcribe")
    generation = whisper["model"].generation_config
    assert prompt == [generation.decoder_start_token_id, generation.lang_to_id["<|en|>"],
                      generation.task_to_id["transcribe"], generation.no_timestamps_token_id]
    assert [w["start"] for w in found.windows] == [0.0]
    assert [w["tokens"] for w in found.windows] == _reference(whisper, samples, prompt)
    translated = transcriber.transcribe(path, language="de", task="translate", max_new_tokens=TOKENS)
    assert [w["tokens"] for w in translated.windows] == _reference(whisper, samples, transcriber.prompt("de", "translate"))


@pytest.mark.xdist_group("seq2seq")
def test_with_timestamps_each_window_equals_transformers_with_its_timestamp_processor(whisper):
    samples = _clip(25.0)
    transcriber = whisper["transcriber"]
    found = transcriber.transcribe(samples, rate=RATE, language="en", max_new_tokens=TOKENS, timestamps=True)
    prompt = transcriber.prompt("en", "transcribe", timestamps=True)
    assert prompt[-1] != transcriber.no_timestamps and len(prompt) == 3
    assert [w["tokens"] for w in found.windows] == _reference(whisper, samples, prompt, timestamps=True)
    first = transcriber.no_timestamps + 1
    assert all(w["tokens"][0] >= first for w in found.windows)  # the rules open with a timestamp
    for window in found.windows:  # each segment inside its window, in order
        times = [t for s in window["segments"] for t in (s["start"], s["end"])]
        assert times == sorted(times) and window["start"] <= times[0] <= window["start"] + 30


@pytest.mark.xdist_group("seq2seq")
def test_the_language_is_detected_as_transformers_detects_it(whisper):
    samples = _clip(8.0)
    found = whisper["transcriber"].transcribe(samples, rate=RATE, max_new_tokens=2)
    features = whisper["extractor"](samples, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        token = int(whisper["model"].detect_language(features)[0])
    codes = {v: k.strip("<|>") for k, v in whisper["model"].generation_config.lang_to_id.items()}
    assert found.language == codes[token]


def test_kvforge_transcribe_prints_what_the_transcriber_gives(whisper, tmp_path):
    from click.testing import CliRunner

    from kvforge.cli import main

    path = tmp_path / "clip.flac"
    soundfile.write(path, _clip(5.0, 22050), 22050)
    result = CliRunner().invoke(main, ["transcribe", str(whisper["folder"] / "export"), str(path), "--language", "en",
                                       "--max-new-tokens", "6", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    [shown] = json.loads(result.stdout)["results"]
    expected = whisper["transcriber"].transcribe(path, language="en", max_new_tokens=6)
    assert shown["windows"] == expected.windows and shown["language"] == "en"
    missing = CliRunner().invoke(main, ["transcribe", str(whisper["folder"] / "export"), str(tmp_path / "no.wav")])
    assert missing.exit_code == 2 and "no.wav is not a file; pass WAV or FLAC audio files" in missing.output


def test_wrong_requests_are_refused_in_one_line(whisper, tmp_path_factory):
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.runtime.drivers.transcribe import Transcriber

    transcriber = whisper["transcriber"]
    with pytest.raises(InputError, match=r"^language 'xx' is not one this model knows: de, en, fr$"):
        transcriber.transcribe(_clip(1.0), rate=RATE, language="xx")
    with pytest.raises(InputError, match=r"^task must be one of transcribe, translate, got 'summarise'"):
        transcriber.prompt("en", "summarise")
    with pytest.raises(InputError, match=r"^samples need their rate"):
        transcriber.transcribe(_clip(1.0))
    text = Seq2SeqGenerator(seq2seq_export(tmp_path_factory, "marian") / "export", threads=1)
    with pytest.raises(InputError, match=r"is not a speech model's export \(its encoder takes token ids\)"):
        Transcriber(text)


def _speech_like(seconds: float) -> np.ndarray:
    """A gliding tone switched on and off (about 4.5 s each way) over noise: the tiny model's timestamps then close
    segments before each window's end, so the next window starts at the last pair (the long-form seek)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    tone = 0.3 * np.sin(2 * np.pi * (200 + 50 * np.sin(t / 3)) * t) * (np.sin(t * 0.7) > 0)
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.xdist_group("seq2seq")
def test_a_95_s_recording_is_decoded_long_form_as_transformers_does(whisper):
    """Each window's tokens, its segments' text tokens and start and end times equal transformers' long-form
    `generate` (the pipeline's call) on the same recording."""
    samples, tokens = _speech_like(95.0), 40
    transcriber, model = whisper["transcriber"], whisper["model"]
    features = whisper["extractor"](samples, sampling_rate=RATE, truncation=False, padding="longest",
                                    return_tensors="pt", return_attention_mask=True)
    with torch.no_grad():
        out = model.generate(features.input_features, attention_mask=features.attention_mask, return_timestamps=True,
                             return_segments=True, language="en", task="transcribe", max_new_tokens=tokens,
                             num_beams=1, do_sample=False)
    expected, first = out["segments"][0], transcriber.no_timestamps + 1
    found = transcriber.transcribe(samples, rate=RATE, language="en", max_new_tokens=tokens, timestamps=True)
    got = [(s["start"], s["end"], s["tokens"]) for w in found.windows for s in w["segments"]]
    assert got == [(round(float(e["start"]), 2), round(float(e["end"]), 2), [t for t in e["tokens"].tolist()
                                                                             if t < first]) for e in expected]
    by_window: dict[int, list[int]] = {}  # transformers' segments grouped by the window that decoded them
    for segment in expected:
        by_window.setdefault(id(segment["result"]), []).extend(segment["tokens"].tolist())
    assert len(found.windows) == len(by_window) == 4
    for window, consumed in zip(found.windows, by_window.values(), strict=True):
        assert window["tokens"][: len(consumed)] == consumed
    starts = [w["start"] for w in found.windows]
    assert starts[0] == 0.0 and all(0 < b - a < 30 for a, b in zip(starts, starts[1:], strict=False))  # a seek back each time
    plain = transcriber.transcribe(samples, rate=RATE, language="en", max_new_tokens=tokens)
    assert plain.text == found.text and "segments" not in plain.windows[0]
