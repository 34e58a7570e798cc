"""Speech input without torch: an audio file read to mono float32 samples (soundfile), resampled to the model's rate
as transformers' speech-recognition pipeline resamples (torchaudio's windowed-sinc resampler, made here with numpy).
Whisper's log-mel features (of a 30 s window, or of a whole recording for long-form decoding) are in log_mel.py
(WhisperFeatures, re-exported here).
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.log_mel import WhisperFeatures

__all__ = ["WhisperFeatures", "load_audio", "resample"]

WHISPER_RATE = 16000
# Filter sizes above this (output phases x taps) come from rate pairs with a tiny common factor (44101 -> 16000 needs
# a 16000 x 44135 filter, 5.6 GB): refused rather than allocated.
MAX_KERNEL_ELEMENTS = 1 << 25
_ROWS_PER_STEP = 1 << 14  # input blocks filtered per matrix product: bounds the temporary copy of strided frames


def _soundfile():
    try:
        import soundfile
    except ImportError as err:  # soundfile (and its libsndfile) is an optional dependency of the runtime
        raise InputError("reading audio files needs the soundfile package: pip install soundfile "
                         "(or pip install 'kvforge[audio]')") from err
    return soundfile


def _open_source(source: Path | str | bytes) -> tuple[object, str]:
    """(what soundfile reads, the name used in messages); one-line InputError for a missing or empty source."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise InputError("audio bytes are empty (0 bytes)")
        return io.BytesIO(data), f"audio bytes ({len(data)} bytes)"
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"audio source must be a file path or the file's bytes, got {type(source).__name__}")
    path = Path(source)
    if not path.is_file():
        raise InputError(f"audio file {path} does not exist or is not a file")
    if path.stat().st_size == 0:
        raise InputError(f"audio file {path} is empty (0 bytes)")
    return path, f"audio file {path}"


def load_audio(source: Path | str | bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of a WAV, FLAC or other file libsndfile reads, from a path or its bytes.

    Several channels become their mean: transformers' ASR pipeline reads files with `ffmpeg -ac 1`, whose default
    stereo downmix is (L + R) / 2 after its normalisation, averages a (2, samples) array (its _to_mono), and
    transformers.audio_utils.load_audio's soundfile backend (librosa's steps) averages all channels; the mean matches
    all three for stereo. Bad input (missing, empty, undecodable, no samples, NaN or infinite samples) is one
    InputError line."""
    target, name = _open_source(source)
    soundfile = _soundfile()
    try:
        with soundfile.SoundFile(target) as audio:
            rate = int(audio.samplerate)
            frames = audio.read(dtype="float32", always_2d=True)  # [samples, channels]
    except (RuntimeError, soundfile.SoundFileError) as err:
        problem = str(getattr(err, "error_string", "") or err).strip().rstrip(".")
        raise InputError(f"{name} could not be decoded: {problem} (soundfile reads WAV, FLAC, OGG/Vorbis, MP3 and "
                         "other libsndfile formats; convert it to WAV or FLAC)") from err
    if frames.shape[0] == 0:
        raise InputError(f"{name} has no samples")
    samples = frames[:, 0] if frames.shape[1] == 1 else frames.mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise InputError(f"{name} has non-finite samples (NaN or infinity)")
    return np.ascontiguousarray(samples, dtype=np.float32), rate


def _rate(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not float(value).is_integer() or value <= 0:
        raise InputError(f"{what} sample rate must be a positive integer, got {value!r}")
    return int(value)


def sinc_kernel(from_rate: int, to_rate: int, lowpass_filter_width: int = 6,
                rolloff: float = 0.99) -> tuple[np.ndarray, int]:
    """(filter [phases, taps], width) of torchaudio's sinc_interp_hann resampler between rates reduced by
    their gcd (`phases` output samples per block of `from` input samples).

    The filter is a low-pass at rolloff x the lower of the two Nyquist rates. With rates reduced to `from` and `to`,
    output phase j sits j/to of a block after the block start and tap k reads the input sample (k - width)/from of a
    block after it; their distance times the cutoff, t (in cutoff periods, clamped to +-lowpass_filter_width),
    weighs the tap by sinc(t) = sin(pi t) / (pi t) times a Hann window cos(pi t / (2 lowpass_filter_width))^2 that
    reaches zero at the clamp, all scaled by cutoff / from so that a constant keeps its level. `width` zero samples
    pad each end of the input so that the filter reaches past it."""
    divisor = math.gcd(from_rate, to_rate)
    source, target = from_rate // divisor, to_rate // divisor
    cutoff = min(source, target) * rolloff
    width = math.ceil(lowpass_filter_width * source / cutoff)
    if target * (2 * width + source) > MAX_KERNEL_ELEMENTS:
        raise InputError(f"resampling {from_rate} Hz to {to_rate} Hz needs a {target} x {2 * width + source} filter "
                         "(the rates share too small a factor); resample the audio to a common rate such as 48000 "
                         "or 44100 Hz first")
    # torchaudio builds the filter in the waveform's dtype, float32 for the pipeline's float32 audio: rounding the
    # tap times to float32 moves coefficients by up to 2e-5 of full scale where the reduced block is long (11025 Hz:
    # 441 taps per phase), so each step below is rounded to float32 in the same order.
    f32 = np.float32
    taps = np.arange(-width, width + source, dtype=f32) / f32(source)
    phases = np.arange(0, -target, -1, dtype=f32) / f32(target)  # minus each phase's delay
    t = np.clip((phases[:, None] + taps[None, :]) * f32(cutoff), f32(-lowpass_filter_width),
                f32(lowpass_filter_width))
    window = np.cos(t * f32(np.pi) / f32(lowpass_filter_width) / f32(2)) ** 2
    t = t * f32(np.pi)
    sinc = np.where(t == 0, f32(1), np.sin(t) / np.where(t == 0, f32(1), t))
    return (sinc * (window * f32(cutoff / source))).astype(np.float64), width


def resample(samples: np.ndarray, from_rate: int, to_rate: int = WHISPER_RATE) -> np.ndarray:
    """Mono samples at from_rate -> float32 samples at to_rate, as torchaudio.functional.resample with its defaults
    (sinc_interp_hann, lowpass_filter_width=6, rolloff=0.99) gives them: what transformers' ASR pipeline runs when an
    array's rate is not the model's. ceil(n * to / from) samples (after reducing the rates by their gcd); the same
    samples (as float32) at equal rates."""
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise InputError(f"resample takes one channel of samples (1-D), got shape {samples.shape}")
    if samples.dtype.kind not in "fiu":
        raise InputError(f"audio samples must be numbers, got dtype {samples.dtype}")
    from_rate, to_rate = _rate(from_rate, "the input"), _rate(to_rate, "the output")
    if from_rate == to_rate:
        return samples.astype(np.float32)
    kernel, width = sinc_kernel(from_rate, to_rate)
    divisor = math.gcd(from_rate, to_rate)
    source, target = from_rate // divisor, to_rate // divisor
    length = samples.size
    padded = np.zeros(length + 2 * width + source, dtype=np.float64)
    padded[width: width + length] = samples
    # One row per block of `source` input samples: the 2 * width + source samples its `target` outputs read.
    rows = np.lib.stride_tricks.sliding_window_view(padded, 2 * width + source)[::source]
    out = np.empty((rows.shape[0], target), dtype=np.float64)
    for start in range(0, rows.shape[0], _ROWS_PER_STEP):
        out[start: start + _ROWS_PER_STEP] = rows[start: start + _ROWS_PER_STEP] @ kernel.T
    return out.reshape(-1)[: math.ceil(target * length / source)].astype(np.float32)
