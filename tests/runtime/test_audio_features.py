"""Speech input without torch (runtime/media/audio.py, log_mel.py): seeded synthetic clips (tones + noise) of
several lengths and sample rates written to WAV/FLAC with soundfile, read back with load_audio, resampled to 16 kHz
and turned into Whisper's log-mel features, compared with transformers' WhisperFeatureExtractor (80 and 128 bins)
on the same 16 kHz samples. The extractor has two paths: numpy in float64 (without torch), the same algorithm as
ours, equal within 1e-6; torch.stft in float32 (with torch, its default here), whose own float32 FFT error reaches
1.3e-4 in bins ~70 dB below their frame's peak (pure tones over a faint noise floor, clip 8): within 2e-4.
The resampler (torchaudio's sinc_interp_hann, made with numpy) is checked by properties: output length, a tone's
samples at the new rate, a constant's level, and the attenuation of tones above the new Nyquist rate. Bad input is
one InputError with a message that says what was wrong."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import soundfile  # a test dependency: these tests write the clips they read (only transformers may be missing)
from test_runtime_standalone import imported_forbidden

from kvforge.core.errors import InputError
from kvforge.runtime.media.audio import WhisperFeatures, load_audio, resample

NUMPY_TOLERANCE = 1e-6  # transformers' float64 numpy path: the same algorithm
# transformers' torch path: torch.stft (MKL) in float32 is off by up to 1.3e-4 where a mel bin is ~70 dB below its
# frame's peak (measured on clip 8, 128 bins; float32 numpy FFTs differ from it as much, so this is not reproducible)
TORCH_TOLERANCE = 2e-4
# (seconds, sample rate, container, subtype, channels)
CLIPS = [
    (0.3, 8000, "WAV", "PCM_16", 1),
    (1.0, 16000, "WAV", "PCM_16", 1),
    (2.5, 22050, "WAV", "FLOAT", 1),
    (4.0, 44100, "FLAC", "PCM_16", 1),
    (7.3, 48000, "WAV", "PCM_24", 2),
    (12.0, 16000, "FLAC", "PCM_24", 1),
    (20.0, 8000, "WAV", "FLOAT", 1),
    (29.9, 22050, "WAV", "PCM_16", 1),
    (30.0, 44100, "WAV", "PCM_16", 1),
    (45.0, 48000, "WAV", "FLOAT", 2),  # over 30 s: features of the first 30 s only
]


def _clip(seconds: float, rate: int, seed: int, channels: int = 1) -> np.ndarray:
    """[samples, channels] float32: three tones below 4 kHz with a slow amplitude change, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    out = []
    for _ in range(channels):
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 3800) * t + rng.uniform(0, 6))
                    for _ in range(3))
        envelope = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(0.1, 2.0) * t)
        out.append(envelope * tones + rng.uniform(0.002, 0.02) * rng.standard_normal(t.size))
    return np.stack(out, axis=1).astype(np.float32)


def _extractor(feature_size: int):
    transformers = pytest.importorskip("transformers")
    return transformers.WhisperFeatureExtractor(feature_size=feature_size)


@pytest.fixture(scope="module")
def clips_16k(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """Each clip written with soundfile, read with load_audio (checked against what was written) and at 16 kHz."""
    folder = tmp_path_factory.mktemp("audio")
    out = []
    for index, (seconds, rate, container, subtype, channels) in enumerate(CLIPS):
        path = folder / f"clip{index}.{container.lower()}"
        soundfile.write(path, _clip(seconds, rate, index, channels), rate, subtype=subtype, format=container)
        samples, read_rate = load_audio(path)
        written, _ = soundfile.read(path, dtype="float32", always_2d=True)
        assert read_rate == rate and samples.dtype == np.float32 and samples.shape == (written.shape[0],)
        np.testing.assert_array_equal(samples, written.mean(axis=1, dtype=np.float32))
        out.append(resample(samples, rate, 16000))
        assert out[-1].size == math.ceil(samples.size * 16000 / rate)
    return out


@pytest.mark.parametrize("index", range(len(CLIPS)))
def test_features_equal_transformers(clips_16k: list[np.ndarray], index: int) -> None:
    samples = clips_16k[index]
    torch_diffs, numpy_diffs = [], []
    for feature_size in (80, 128):
        extractor = _extractor(feature_size)
        features = WhisperFeatures(feature_size=feature_size)
        got = features.features(samples)
        expected = extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0]
        assert got.shape == expected.shape == (feature_size, 3000) and got.dtype == np.float32
        torch_diffs.append(float(np.abs(got - expected).max()))
        # the extractor's numpy path (what it runs without torch) on the clip padded/cut as it pads it
        expected = extractor._np_extract_fbank_features(features.fit(samples)[None], "cpu")[0]
        numpy_diffs.append(float(np.abs(got - expected).max()))
    print(f"clip {index} {CLIPS[index][:2]}: max |diff| 80/128 bins: torch path {torch_diffs[0]:.2e}/"
          f"{torch_diffs[1]:.2e}, numpy path {numpy_diffs[0]:.2e}/{numpy_diffs[1]:.2e}")
    assert max(numpy_diffs) < NUMPY_TOLERANCE
    assert max(torch_diffs) < TORCH_TOLERANCE


def test_padding_and_truncation_follow_transformers() -> None:
    features = WhisperFeatures()
    clip = np.arange(5, dtype=np.float64)
    fitted = features.fit(clip)
    assert fitted.dtype == np.float32 and fitted.size == 480000 and (fitted[5:] == 0).all()
    long = np.random.default_rng(3).standard_normal(480000 + 1000).astype(np.float32)
    np.testing.assert_array_equal(features.features(long), features.features(long[:480000]))
    padded = WhisperFeatures(padding_value=0.25).fit(clip)
    assert (padded[5:] == 0.25).all()


@pytest.mark.parametrize("seconds", [31.0, 45.01, 95.0])
def test_a_whole_recordings_features_equal_the_extractors_long_form_call(seconds: float) -> None:
    """Long-form decoding's features (transformers' pipeline: truncation=False, padding="longest"): every frame of
    the recording, its floor set by the whole recording's maximum; a window is a slice of them."""
    rng = np.random.default_rng(int(seconds))
    samples = (0.2 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)
    samples[: 16000 * 5] *= 4  # a louder start: its maximum sets the floor of the quieter rest
    for feature_size in (80, 128):
        expected = _extractor(feature_size)(samples, sampling_rate=16000, truncation=False, padding="longest",
                                            return_tensors="np", return_attention_mask=True)
        got = WhisperFeatures(feature_size=feature_size).whole(samples)
        assert got.shape == expected.input_features[0].shape == (feature_size, int(seconds * 16000) // 160)
        assert got.shape[1] == int(expected.attention_mask.sum())
        assert float(np.abs(got - expected.input_features[0]).max()) < TORCH_TOLERANCE
    with pytest.raises(InputError, match="too short for Whisper's features"):
        WhisperFeatures().whole(np.zeros(100, np.float32))


def test_batch_and_settings_from_preprocessor_config(clips_16k: list[np.ndarray]) -> None:
    extractor = _extractor(128)
    config = extractor.to_dict()  # the keys of a preprocessor_config.json
    assert {"n_samples", "nb_max_frames", "padding_value", "chunk_length"} <= set(config)
    features = WhisperFeatures.from_config(config)
    assert (features.feature_size, features.n_samples, features.nb_max_frames) == (128, 480000, 3000)
    batch = [clips_16k[1], clips_16k[4], clips_16k[9]]
    expected = extractor(batch, sampling_rate=16000, return_tensors="np").input_features
    got = features.batch(batch)
    assert got.shape == expected.shape == (3, 128, 3000)
    assert np.abs(got - expected).max() < TORCH_TOLERANCE
    np.testing.assert_array_equal(got[1], features.features(batch[1]))  # each clip's own floor


@pytest.mark.parametrize(("config", "message"), [
    ({"nb_max_frames": 1500}, "nb_max_frames=1500 disagrees"),
    ({"n_samples": 160000}, "n_samples=160000 disagrees"),
    ({"dither": 0.5}, "dither=0.5 is not supported"),
    ({"feature_size": 0}, "feature_size must be a positive integer"),
    ({"hop_length": 160.5}, "hop_length must be a positive integer"),
    ({"padding_value": "silence"}, "padding_value must be a number, got 'silence'"),
    ("feature_size=80", "must be a dict, got str"),
])
def test_bad_feature_settings(config: object, message: str) -> None:
    with pytest.raises(InputError, match=message):
        WhisperFeatures.from_config(config)  # type: ignore[arg-type]


def test_bad_clips() -> None:
    features = WhisperFeatures()
    with pytest.raises(InputError, match=r"one channel of samples \(1-D\), got shape \(2, 100\)"):
        features.features(np.zeros((2, 100), np.float32))
    with pytest.raises(InputError, match="non-finite"):
        features.features(np.array([0.0, np.nan], np.float32))
    with pytest.raises(InputError, match="takes a list of clips"):
        features.batch(np.zeros(100, np.float32))


def test_resample_keeps_a_tone() -> None:
    # A 1 kHz tone at each rate, resampled to 16 kHz, equals the tone sampled at 16 kHz away from the ends (where
    # the filter reads the zero padding). Amplitude 0.5: the passband ripple of the filter is below 1e-3.
    for rate in (8000, 11025, 22050, 44100, 48000, 96000):
        n = rate  # one second
        tone = 0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(n) / rate)
        got = resample(tone.astype(np.float32), rate, 16000)
        assert got.dtype == np.float32 and got.size == 16000
        expected = 0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(16000) / 16000)
        assert np.abs(got[400:-400] - expected[400:-400]).max() < 2e-3, rate


def test_resample_lengths_and_identity() -> None:
    rng = np.random.default_rng(1)
    for n, from_rate, to_rate in [(1, 44100, 16000), (7, 22050, 16000), (441, 44100, 16000), (1000, 8000, 16000),
                                  (12345, 48000, 16000), (3, 16000, 44100), (999, 11025, 16000)]:
        assert resample(rng.standard_normal(n), from_rate, to_rate).size == math.ceil(n * to_rate / from_rate)
    samples = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(resample(samples, 16000, 16000), samples)
    # A constant keeps its level (the filter's gain at 0 Hz is 1) away from the ends.
    assert np.abs(resample(np.ones(44100, np.float32), 44100)[200:-200] - 1.0).max() < 2e-3


def test_resample_removes_tones_above_the_new_nyquist_rate() -> None:
    # Tones above 8 kHz (16 kHz audio's Nyquist rate) would alias below it. torchaudio's default filter (cutoff
    # 0.99 x 8 kHz, Hann-windowed sinc of 6 zero crossings) has a wide transition band: from 10 kHz on it takes
    # them down by more than 40 dB (-45.3 dB at 10 kHz, -55.1 at 12, -74.7 at 15, measured); 9 kHz is only -16.8 dB
    # (torchaudio's own figure, ours within 6.6e-7 of it): a sharper or wider filter would fail that bracket.
    def attenuation_db(rate: int, hz: float) -> float:
        tone = np.sin(2 * np.pi * hz * np.arange(2 * rate) / rate).astype(np.float32)
        out = resample(tone, rate)[1000:-1000].astype(np.float64)
        return float(20 * np.log10(np.sqrt(np.mean(out**2)) / np.sqrt(0.5)))

    for rate, hz in ((44100, 10000.0), (48000, 10000.0), (48000, 12000.0), (96000, 15000.0), (22050, 10500.0)):
        assert attenuation_db(rate, hz) < -40.0, (rate, hz)
    assert -18.0 < attenuation_db(48000, 9000.0) < -15.5


def test_bad_resample_input() -> None:
    with pytest.raises(InputError, match="one channel of samples"):
        resample(np.zeros((100, 2)), 44100)
    with pytest.raises(InputError, match="input sample rate must be a positive integer, got 0"):
        resample(np.zeros(100), 0)
    with pytest.raises(InputError, match="input sample rate must be a positive integer, got 44100.5"):
        resample(np.zeros(100), 44100.5)
    with pytest.raises(InputError, match="share too small a factor"):
        resample(np.zeros(100), 44101)


def test_bad_audio_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.wav is empty \(0 bytes\)"):
        load_audio(empty)
    with pytest.raises(InputError, match=r"audio bytes are empty"):
        load_audio(b"")
    with pytest.raises(InputError, match=r"audio bytes \(400 bytes\) could not be decoded: Format not recognised"):
        load_audio(bytes(range(200)) * 2)
    with pytest.raises(InputError, match="does not exist"):
        load_audio(tmp_path / "missing.flac")
    for wrong in (3, np.zeros(10), None):
        with pytest.raises(InputError, match="must be a file path or the file's bytes, got"):
            load_audio(wrong)  # type: ignore[arg-type]
    silent = tmp_path / "silent.wav"
    soundfile.write(silent, np.zeros(0, np.float32), 16000, subtype="PCM_16")
    with pytest.raises(InputError, match=r"silent\.wav has no samples"):
        load_audio(silent)
    broken = tmp_path / "nan.wav"
    soundfile.write(broken, np.array([0.1, np.nan, 0.2], np.float32), 16000, subtype="FLOAT")
    with pytest.raises(InputError, match="non-finite samples"):
        load_audio(broken.read_bytes())
    monkeypatch.setitem(__import__("sys").modules, "soundfile", None)  # as if soundfile were not installed
    with pytest.raises(InputError, match="pip install soundfile"):
        load_audio(broken)


def test_audio_input_pulls_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "a.flac"
    soundfile.write(path, _clip(0.5, 22050, 0), 22050, format="FLAC")
    code = ("from kvforge.runtime.media.audio import WhisperFeatures, load_audio, resample\n"
            f"samples, rate = load_audio({str(path)!r})\n"
            "assert WhisperFeatures().features(resample(samples, rate)).shape == (80, 3000)")
    assert imported_forbidden(code) == []
