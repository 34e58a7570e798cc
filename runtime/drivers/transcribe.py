"""Speech to text with a Whisper export: audio in 30 s windows (runtime/media/audio.py), each window's log-mel
features (runtime/media/log_mel.py) through the encoder once, its text decoded after Whisper's task prompt
(<|startoftranscript|>, the language, <|transcribe|> or <|translate|>, <|notimestamps|>), as transformers' Whisper
`generate` writes it. The language is detected from the first window where it is not given (the most likely language
token after <|startoftranscript|>, as transformers' `detect_language`).

Timestamps are not produced yet: each window's text is its own, joined in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError, ManifestError
from kvforge.runtime.drivers.seq2seq import MAX_NEW_TOKENS, Seq2SeqGenerator

TASKS = ("transcribe", "translate")


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

    def prompt(self, language: str | None, task: str) -> list[int]:
        """The decoder's first tokens: start, language and task (a multilingual model), no timestamps."""
        if task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        start = self.generator.record.decoder_start_token_id
        if not self.languages:  # an English-only checkpoint: no language or task tokens
            return [start, self.no_timestamps]
        if language not in self.languages:
            raise InputError(f"language {language!r} is not one this model knows: {', '.join(sorted(self.languages))}")
        return [start, self.languages[language], self.tasks[task], self.no_timestamps]

    def detect_language(self, encoded: Any) -> str:
        """The most likely language token after the start token, on the first row of `encoded`."""
        logits = self.generator.next_logits(encoded, [self.generator.record.decoder_start_token_id])[0]
        codes = sorted(self.languages)
        return codes[int(np.argmax([logits[self.languages[code]] for code in codes]))]

    def transcribe(self, audio: str | Path | bytes | np.ndarray, rate: int | None = None, language: str | None = None,
                   task: str = "transcribe", max_new_tokens: int = MAX_NEW_TOKENS,
                   sampling: Any = None) -> Transcription:
        """`audio`: a file (path or bytes, WAV/FLAC) or samples (mono float, at `rate`); `sampling`: a SamplingConfig
        (default greedy)."""
        from kvforge.runtime.media.audio import load_audio, resample, windows

        if isinstance(audio, np.ndarray):
            if rate is None:
                raise InputError("samples need their rate: transcribe(samples, rate=...)")
            samples, rate = np.asarray(audio, np.float32), rate
        else:
            samples, rate = load_audio(audio)
        samples = resample(samples, rate, self.features.sampling_rate)
        parts = windows(samples, self.features.sampling_rate, self.features.n_samples / self.features.sampling_rate)
        encoded = self.generator.encode_features(self.features.batch([clip for _, clip in parts]))
        if language is None and self.languages:
            language = self.detect_language(encoded)
        prompt = self.prompt(language, task)
        limit = self.generator.layout.max_capacity - len(prompt)
        tokens = self.generator.generate_ids(encoded, min(max_new_tokens, limit), prompt=prompt, sampling=sampling)
        tokenizer, eos = self.generator.tokenizer(), set(self.generator.rules.eos)
        found = [{"start": start, "tokens": row, "text": tokenizer.decode([t for t in row if t not in eos]).strip()}
                 for (start, _), row in zip(parts, tokens, strict=True)]
        return Transcription(" ".join(w["text"] for w in found if w["text"]), language, found)
