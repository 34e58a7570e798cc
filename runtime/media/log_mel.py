"""Whisper's log-mel input features made with numpy, as transformers' WhisperFeatureExtractor makes them for a clip
with its call defaults (padding="max_length", truncation=True, no normalisation, no dither).

Steps, each as the extractor takes them: the clip (float32) is padded with `padding_value` or cut to `n_samples`
(30 s); a centred STFT (the signal reflect-padded by n_fft // 2 on both sides, frames every `hop_length` samples,
a periodic Hann window of n_fft, an n_fft-point real FFT) gives a power spectrum; the last frame is dropped (so
30 s give 3000 frames); a mel filter bank (slaney mel scale, slaney area normalisation, 0..8000 Hz, triangles in Hz)
maps it to `feature_size` bins; log10 with a 1e-10 floor; everything below the clip's maximum minus 8 is raised to
it; (x + 4) / 4. Computed in float64 and returned as float32: transformers computes it in float32 with torch.stft
when torch is installed (float64 with numpy otherwise), so the two differ by float32 rounding only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvforge.core.errors import InputError

# WhisperFeatureExtractor builds its filters up to 8 kHz whatever the sampling rate (the models were trained so).
MEL_MAX_HZ = 8000.0
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # log10 units below the clip's maximum kept (80 dB)


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above (27 mels per factor 6.4)."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = 3.0 * hz / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-300) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz >= 1000.0, log, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """The inverse of hz_to_mel."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = 200.0 * mel / 3.0
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log, linear)


def mel_filters(n_fft: int, n_mels: int, sampling_rate: int, max_hz: float = MEL_MAX_HZ) -> np.ndarray:
    """[n_fft // 2 + 1, n_mels] float64 triangles between mel-spaced edges (0 Hz..max_hz), each scaled by 2 / its
    width in Hz (slaney normalisation: about equal energy per filter), as transformers' mel_filter_bank builds it
    with norm="slaney", mel_scale="slaney"."""
    bins = n_fft // 2 + 1
    edges = mel_to_hz(np.linspace(hz_to_mel(np.float64(0.0)), hz_to_mel(np.float64(max_hz)), n_mels + 2))
    # transformers spaces the FFT bins up to the integer Nyquist (sampling_rate // 2), not sampling_rate / 2
    fft_hz = np.linspace(0, sampling_rate // 2, bins)
    offsets = edges[None, :] - fft_hz[:, None]  # [bins, n_mels + 2]
    widths = np.diff(edges)
    rising = -offsets[:, :-2] / widths[:-1]  # from the lower edge up to the centre
    falling = offsets[:, 2:] / widths[1:]  # from the centre down to the upper edge
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def hann_periodic(length: int) -> np.ndarray:
    """The periodic Hann window (torch.hann_window's default): one period of length `length`, last point left out."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / length)


def _setting(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = _setting(config, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"Whisper feature setting {key} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class WhisperFeatures:
    """The feature settings of a Whisper export (the keys of its preprocessor_config.json) and the features they
    give: `features(clip)` -> [feature_size, nb_max_frames] float32, `batch(clips)` -> [clips, feature_size,
    nb_max_frames]. Defaults are WhisperFeatureExtractor's (80 bins, 16 kHz, hop 160, 30 s, n_fft 400)."""

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0

    def __post_init__(self) -> None:
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(f"Whisper feature setting {name} must be a positive integer, got {value!r}")
        if not np.isfinite(self.padding_value):
            raise InputError(f"Whisper feature setting padding_value must be finite, got {self.padding_value!r}")
        # A centred STFT reflect-pads by n_fft // 2, which needs more samples than that in the padded clip.
        if self.n_samples <= self.n_fft // 2:
            raise InputError(f"Whisper feature settings give {self.n_samples} samples per clip, too few for "
                             f"n_fft={self.n_fft}")
        object.__setattr__(self, "_filters", mel_filters(self.n_fft, self.feature_size, self.sampling_rate))
        object.__setattr__(self, "_window", hann_periodic(self.n_fft))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> WhisperFeatures:
        """From a preprocessor_config.json's dict. n_samples and nb_max_frames are derived by the extractor
        (chunk_length * sampling_rate, n_samples // hop_length): when present they must agree; a non-zero dither
        (random noise transformers adds to each clip) cannot be reproduced and is refused."""
        if not isinstance(config, Mapping):
            raise InputError(f"Whisper feature settings must be a dict, got {type(config).__name__}")
        if _number(config, "dither", 0.0) != 0.0:
            raise InputError(f"Whisper feature setting dither={config['dither']!r} is not supported (only 0.0: "
                             "transformers adds random noise then)")
        made = cls(feature_size=_setting(config, "feature_size", 80),
                   sampling_rate=_setting(config, "sampling_rate", 16000),
                   hop_length=_setting(config, "hop_length", 160), chunk_length=_setting(config, "chunk_length", 30),
                   n_fft=_setting(config, "n_fft", 400), padding_value=_number(config, "padding_value", 0.0))
        for key in ("n_samples", "nb_max_frames"):
            if config.get(key) is not None and config[key] != getattr(made, key):
                raise InputError(f"Whisper feature setting {key}={config[key]!r} disagrees with chunk_length, "
                                 f"sampling_rate and hop_length (which give {getattr(made, key)})")
        return made

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @property
    def filters(self) -> np.ndarray:
        """[n_fft // 2 + 1, feature_size] float64 mel filter bank."""
        return self._filters  # type: ignore[attr-defined]

    def fit(self, clip: np.ndarray) -> np.ndarray:
        """The clip as float32, padded with padding_value or cut to n_samples (transformers' pad step)."""
        samples = _checked(np.asarray(clip)[: self.n_samples])
        fitted = np.full(self.n_samples, self.padding_value, dtype=np.float32)
        fitted[: samples.size] = samples
        return fitted

    def power_spectrum(self, fitted: np.ndarray) -> np.ndarray:
        """[n_fft // 2 + 1, frames] float64 power of the centred STFT of a fitted clip, the last frame dropped."""
        half = self.n_fft // 2
        padded = np.pad(fitted.astype(np.float64), (half, half), mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, self.n_fft)[:: self.hop_length]
        spectrum = np.fft.rfft(frames[:-1] * self._window, n=self.n_fft, axis=-1)  # type: ignore[attr-defined]
        return (spectrum.real**2 + spectrum.imag**2).T

    def features(self, clip: np.ndarray) -> np.ndarray:
        """[feature_size, nb_max_frames] float32 input_features of one clip at sampling_rate."""
        return self._log_mel(self.fit(clip))

    def whole(self, samples: np.ndarray) -> np.ndarray:
        """[feature_size, len(samples) // hop_length] float32 features of a whole recording, as the extractor makes
        them for long-form decoding (truncation=False, padding="longest"): nothing padded or cut, and the floor set by
        the whole recording's maximum. A 30 s window is then a slice of these frames."""
        samples = _checked(samples)
        if samples.size <= self.n_fft // 2:
            raise InputError(f"a recording of {samples.size} samples is too short for Whisper's features (more than "
                             f"{self.n_fft // 2} needed)")
        return self._log_mel(samples)

    def _log_mel(self, fitted: np.ndarray) -> np.ndarray:
        mel = self.filters.T @ self.power_spectrum(fitted)
        log_mel = np.log10(np.maximum(mel, LOG_FLOOR))
        log_mel = np.maximum(log_mel, log_mel.max() - DYNAMIC_RANGE)
        return ((log_mel + 4.0) / 4.0).astype(np.float32)

    def batch(self, clips: Sequence[np.ndarray]) -> np.ndarray:
        """[len(clips), feature_size, nb_max_frames] float32: each clip on its own (its own maximum sets its
        floor, as in the extractor's batches)."""
        if isinstance(clips, np.ndarray) and clips.ndim == 1:
            raise InputError("batch() takes a list of clips; use features() for one clip")
        if len(clips) == 0:
            raise InputError("batch() needs at least one audio clip")
        return np.stack([self.features(clip) for clip in clips])


def _checked(clip: np.ndarray) -> np.ndarray:
    """One channel of finite numbers, as float32."""
    samples = np.asarray(clip)
    if samples.ndim != 1:
        raise InputError(f"an audio clip must be one channel of samples (1-D), got shape {samples.shape}")
    if samples.dtype.kind not in "fiu":
        raise InputError(f"audio samples must be numbers, got dtype {samples.dtype}")
    samples = samples.astype(np.float32)
    if not np.isfinite(samples).all():
        raise InputError("audio clip has non-finite samples (NaN or infinity)")
    return samples
