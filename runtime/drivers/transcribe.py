"""Speech to text with a Whisper export: audio in 30 s windows (runtime/media/audio.py), each window's log-mel
features (runtime/media/log_mel.py) through the encoder once, its text decoded after Whisper's task prompt
(<|startoftranscript|>, the language, <|transcribe|> or <|translate|>, <|notimestamps|>), as transformers' Whisper
`generate` writes it. The language is detected from the first window where it is not given (the most likely language
token after <|startoftranscript|>, as transformers' `detect_language`).

With timestamps, each window's timed segments (runtime/drivers/timestamps.py); the windows are plain 30 s cuts (the
long-form decoding that moves each cut to the window's last timestamp is not done yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError, ManifestError
from kvforge.runtime.drivers.seq2seq import MAX_NEW_TOKENS, Seq2SeqGenerator
from kvforge.runtime.drivers.timestamps import TimestampRules, segments

TASKS = ("transcribe", "translate")
WINDOWS_PER_RUN = 4  # 30 s windows through the encoder and decoder together


@dataclass
class Transcription:
    text: str
    language: str | None
    windows: list[dict[str, Any]] = field(default_factory=list)  # {"start": seconds, "text", "tokens"} in order


class Transcriber:
    """transcribe(audio) -> Transcription, over a Seq2SeqGenerator of a Whisper export."""

    def __init__(self, generator: Seq2SeqGenerator) -> None:
        from kvforge.runtime.media.log_mel import WhisperFeatures

        if generator.record.input != "features":
            raise InputError(f"{generator.folder} is not a speech model's export (its encoder takes token ids); "
                             "kvforge transcribe takes a Whisper export")
        self.generator = generator
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
        (default greedy); `timestamps`: decode Whisper's timestamp tokens too, each window's timed segments in its
        "segments" (runtime/drivers/timestamps.py)."""
        from kvforge.runtime.media.audio import load_audio, resample, windows

        if isinstance(audio, np.ndarray):
            if rate is None:
                raise InputError("samples need their rate: transcribe(samples, rate=...)")
            samples, rate = np.asarray(audio, np.float32), rate
        else:
            samples, rate = load_audio(audio)
        samples = resample(samples, rate, self.features.sampling_rate)
        parts = windows(samples, self.features.sampling_rate, self.features.n_samples / self.features.sampling_rate)
        tokens: list[list[int]] = []
        # A few windows a run: each window's cross keys and values are the encoder's whole output for it (~0.5 GB in
        # fp32 for large-v3), so a long recording is not encoded at once.
        for first in range(0, len(parts), WINDOWS_PER_RUN):
            clips = [clip for _, clip in parts[first: first + WINDOWS_PER_RUN]]
            encoded = self.generator.encode_features(self.features.batch(clips))
            if language is None and self.languages:
                language = self.detect_language(encoded)  # from the first window
            prompt = self.prompt(language, task, timestamps)
            limit = self.generator.layout.max_capacity - len(prompt)
            rules = self._rules(len(prompt)) if timestamps else None
            tokens += self.generator.generate_ids(encoded, min(max_new_tokens, limit), prompt=prompt,
                                                  sampling=sampling, rules=rules)
        tokenizer, eos = self.generator.tokenizer(), set(self.generator.rules.eos)
        text_of = [[t for t in row if t not in eos and t <= self.no_timestamps] for row in tokens]
        found = [{"start": start, "tokens": row, "text": tokenizer.decode(text).strip()}
                 for (start, _), row, text in zip(parts, tokens, text_of, strict=True)]
        if timestamps:
            end = next(iter(eos), -1)
            for window in found:
                window["segments"] = segments(window["tokens"], self.no_timestamps + 1, window["start"], end,
                                              tokenizer.decode)
        return Transcription(" ".join(w["text"] for w in found if w["text"]), language, found)

    def _rules(self, begin: int) -> Any:
        """The export's decoding rules with Whisper's timestamp rules after them."""
        import dataclasses

        generation = self.generator.manifest.get("generation") or {}
        eos = self.generator.rules.eos[0] if self.generator.rules.eos else generation.get("bos_token_id")
        stamps = TimestampRules(self.no_timestamps, eos, begin, generation.get("max_initial_timestamp_index"))
        return dataclasses.replace(self.generator.rules, timestamps=stamps)
