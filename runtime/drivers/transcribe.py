"""Speech to text with a Whisper export: audio in 30 s windows (runtime/media/audio.py), each window's log-mel
features (runtime/media/log_mel.py) through the encoder once, its text decoded after Whisper's task prompt
(<|startoftranscript|>, the language, <|transcribe|> or <|translate|>, <|notimestamps|>), as transformers' Whisper
`generate` writes it. The language is detected from the first window where it is not given (the most likely language
token after <|startoftranscript|>, as transformers' `detect_language`).

With timestamps, each window's timed segments (runtime/drivers/timestamps.py). A recording longer than one window is
decoded long-form, as transformers' Whisper `generate` (and so its pipeline) does: features of the whole recording,
then window after window, each decoded with timestamps and the next one starting at the last timestamp pair the
window closed (runtime/drivers/timestamps.py `long_form_segments`), so a word cut by a window's end is decoded again
whole in the next. Windows then depend on each other: they run one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError, ManifestError
from kvforge.runtime.drivers.seq2seq import MAX_NEW_TOKENS, Seq2SeqGenerator
from kvforge.runtime.drivers.timestamps import TimestampRules, long_form_segments, segments

TASKS = ("transcribe", "translate")


@dataclass
class Transcription:
    text: str
    language: str | None
    windows: list[dict[str, Any]] = field(default_factory=list)  # {"start": seconds, "text", "tokens"} in order


class Transcriber:
    """transcribe(audio) -> Transcription, over a Seq2SeqGenerator of a Whisper export."""

    def __init__(self, generator: Seq2SeqGenerator, decoder: Any = None) -> None:
        """`decoder`: what decodes the windows (its `generate_ids`), the generator itself by default; the server
        passes its Seq2SeqBatcher (runtime/drivers/seq2seq_batch.py), which decodes them beside other requests'."""
        from kvforge.runtime.media.log_mel import WhisperFeatures

        if generator.record.input != "features":
            raise InputError(f"{generator.folder} is not a speech model's export (its encoder takes token ids); "
                             "kvforge transcribe takes a Whisper export")
        self.generator, self.decoder = generator, decoder if decoder is not None else generator
        self.features = WhisperFeatures.from_config(generator.record.features)
        generation = generator.manifest.get("generation") or {}
        self.languages = {token.strip("<|>"): token_id for token, token_id in (generation.get("lang_to_id") or {}).items()}
        self.tasks = dict(generation.get("task_to_id") or {})
        self.no_timestamps = generation.get("no_timestamps_token_id")
        if self.no_timestamps is None:
            raise ManifestError(f"{generator.folder}: its generation config names no <|notimestamps|> token; re-export "
                                "from a Whisper checkpoint folder with its generation_config.json")

    def prompt(self, language: str | None, task: str, timestamps: bool = False) -> list[int]:
        """The decoder's first tokens: start, language and task (a multilingual model), and <|notimestamps|> unless
        `timestamps`."""
        if task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        start, last = self.generator.record.decoder_start_token_id, [] if timestamps else [self.no_timestamps]
        if not self.languages:  # an English-only checkpoint: no language or task tokens
            return [start, *last]
        if language not in self.languages:
            raise InputError(f"language {language!r} is not one this model knows: {', '.join(sorted(self.languages))}")
        return [start, self.languages[language], self.tasks[task], *last]

    def detect_language(self, encoded: Any) -> str:
        """The most likely language token after the start token, on the first row of `encoded`."""
        logits = self.generator.next_logits(encoded, [self.generator.record.decoder_start_token_id])[0]
        codes = sorted(self.languages)
        return codes[int(np.argmax([logits[self.languages[code]] for code in codes]))]

    def transcribe(self, audio: str | Path | bytes | np.ndarray, rate: int | None = None, language: str | None = None,
                   task: str = "transcribe", max_new_tokens: int = MAX_NEW_TOKENS,
                   sampling: Any = None, timestamps: bool = False) -> Transcription:
        """`audio`: a file (path or bytes, WAV/FLAC) or samples (mono float, at `rate`); `sampling`: a SamplingConfig
        (default greedy); `timestamps`: each window's timed segments in its "segments" (runtime/drivers/timestamps.py).
        Up to 30 s: one window, decoded after the task prompt (with timestamps only when asked); longer: long-form
        (`_long_form`)."""
        from kvforge.runtime.media.audio import load_audio, resample

        if isinstance(audio, np.ndarray):
            if rate is None:
                raise InputError("samples need their rate: transcribe(samples, rate=...)")
            samples, rate = np.asarray(audio, np.float32), rate
        else:
            samples, rate = load_audio(audio)
        samples = resample(samples, rate, self.features.sampling_rate)
        if samples.size > self.features.n_samples:
            return self._long_form(samples, language, task, max_new_tokens, sampling, timestamps)
        encoded = self.generator.encode_features(self.features.batch([samples]))  # one window, padded to 30 s
        if language is None and self.languages:
            language = self.detect_language(encoded)
        prompt = self.prompt(language, task, timestamps)
        limit = self.generator.layout.max_capacity - len(prompt)
        rules = self._rules(len(prompt)) if timestamps else None
        [tokens] = self.decoder.generate_ids(encoded, min(max_new_tokens, limit), prompt=prompt, sampling=sampling,
                                             rules=rules)
        tokenizer, eos = self.generator.tokenizer(), set(self.generator.rules.eos)
        text = tokenizer.decode([t for t in tokens if t not in eos and t <= self.no_timestamps]).strip()
        window = {"start": 0.0, "tokens": tokens, "text": text}
        if timestamps:
            window["segments"] = segments(tokens, self.no_timestamps + 1, 0.0, next(iter(eos), -1), tokenizer.decode)
        return Transcription(text, language, [window])

    def _long_form(self, samples: np.ndarray, language: str | None, task: str, max_new_tokens: int, sampling: Any,
                   timestamps: bool) -> Transcription:
        """Window after window over the whole recording's features, each starting where the last one's segments end
        (see the module's docstring); the windows' text is their segments' (timestamps are decoded either way)."""
        features = self.features.whole(samples)
        frames, window = features.shape[1], self.features.nb_max_frames
        stride = window // self.generator.record.max_length  # feature frames per encoder position (2)
        frame_time = self.features.hop_length / self.features.sampling_rate
        tokenizer, eos = self.generator.tokenizer(), set(self.generator.rules.eos)
        found, seek = [], 0
        while seek < frames:
            held = min(frames - seek, window)
            clip = np.zeros((1, features.shape[0], window), np.float32)  # the last window padded with zeros
            clip[0, :, :held] = features[:, seek: seek + held]
            encoded = self.generator.encode_features(clip)
            if language is None and self.languages:
                language = self.detect_language(encoded)  # from the first window
            prompt = self.prompt(language, task, timestamps=True)
            limit = self.generator.layout.max_capacity - len(prompt)
            tokens = self.decoder.generate_ids(encoded, min(max_new_tokens, limit), prompt=prompt, sampling=sampling,
                                               rules=self._rules(len(prompt)))[0]
            if tokens and tokens[-1] in eos:
                tokens = tokens[:-1]
            start = seek * frame_time
            parts, advance = long_form_segments(tokens, self.no_timestamps + 1, start, held, stride, tokenizer.decode)
            window_record = {"start": round(start, 2), "tokens": tokens,
                             "text": " ".join(part["text"] for part in parts if part["text"])}
            found.append({**window_record, "segments": parts} if timestamps else window_record)
            seek += advance if advance > 0 else held  # (a window closed only at <|0.00|> would repeat for ever)
        return Transcription(" ".join(w["text"] for w in found if w["text"]), language, found)

    def _rules(self, begin: int) -> Any:
        """The export's decoding rules with Whisper's timestamp rules after them."""
        import dataclasses

        generation = self.generator.manifest.get("generation") or {}
        eos = self.generator.rules.eos[0] if self.generator.rules.eos else generation.get("bos_token_id")
        stamps = TimestampRules(self.no_timestamps, eos, begin, generation.get("max_initial_timestamp_index"))
        return dataclasses.replace(self.generator.rules, timestamps=stamps)
