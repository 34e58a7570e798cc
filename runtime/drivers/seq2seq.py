"""Generation from an encoder-decoder export (kvforge/core/encoder_contract.py) on ONNX Runtime CPU.

The encoder runs once per batch of sources; its cross keys and values are bound once as the decoder's inputs, and
the decoder's self-attention cache is preallocated and bound as both past and present (the fused op writes the new
rows in place), as the decoder-only runtime does. Decoding starts from the export's decoder start token (and a
prompt of forced tokens: mBART's target language, Whisper's task tokens), applies the checkpoint's generation rules
that greedy decoding reads (DecodingRules) and stops each row at an end token.

Greedy and sampled decoding; no beam search (the checkpoints' generation configs often ask for beams: results are
then those of `generate(num_beams=1)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import (
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    PAST_LENS,
    KVLayout,
    cache_input,
    cache_output,
)
from kvforge.core.encoder_contract import (
    ENCODER,
    ENCODER_INPUT_IDS,
    ENCODER_LENS,
    INPUT_FEATURES,
    EncoderRecord,
    cross_names,
)
from kvforge.core.errors import InputError
from kvforge.core.manifest import load_manifest
from kvforge.runtime.backends.ort_sessions import open_session
from kvforge.runtime.controls.sampling import Sampler, SamplingConfig

MAX_NEW_TOKENS = 64


@dataclass
class Encoded:
    """A batch of sources through the encoder: the cross keys and values (graph order) and each row's length."""

    cross: list[np.ndarray]
    lens: np.ndarray  # [B] int32


@dataclass(frozen=True)
class DecodingRules:
    """The generation config's rules that a greedy or sampled decoder reads (HF's logits processors of the same
    names): a forced first and last token, tokens never generated, tokens not generated first, a minimum length, no
    repeated n-grams, and the end tokens."""

    eos: tuple[int, ...] = ()
    forced_bos: int | None = None
    forced_eos: int | None = None  # the last token a generation may give, where it reaches its limit
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    min_length: int = 0  # no end token before the decoder's sequence (its start token counted) is this long
    no_repeat_ngram: int = 0
    timestamps: Any = None  # Whisper's timestamp rules (runtime/drivers/timestamps.py), after the others

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> DecodingRules:
        generation = manifest.get("generation") or {}
        eos = generation.get("eos_token_id", manifest["model"].get("eos_token_id"))
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        suppress = list(generation.get("suppress_tokens") or ())
        # Marian's generation config bans its pad token as a one-token bad word: the same rule.
        suppress += [words[0] for words in generation.get("bad_words_ids") or () if len(words) == 1]
        forced_eos = generation.get("forced_eos_token_id")
        forced_eos = forced_eos[0] if isinstance(forced_eos, list) and forced_eos else forced_eos
        return cls(eos=eos, forced_bos=generation.get("forced_bos_token_id"), forced_eos=forced_eos,
                   suppress=tuple(suppress), begin_suppress=tuple(generation.get("begin_suppress_tokens") or ()),
                   min_length=int(generation.get("min_length") or 0),
                   no_repeat_ngram=int(generation.get("no_repeat_ngram_size") or 0))

    def apply(self, logits: np.ndarray, step: int, history: Sequence[Sequence[int]], last: bool = False) -> np.ndarray:
        """`logits` [B, V] of generated token `step` (0: the first; `last`: at the generation's limit) with the rules
        applied; `history`: each row's decoder tokens so far (its prompt, then what it generated)."""
        lowest = np.finfo(logits.dtype).min
        logits = logits.copy()
        if self.suppress:
            logits[:, list(self.suppress)] = lowest
        if step == 0 and self.begin_suppress:
            logits[:, list(self.begin_suppress)] = lowest
        if self.eos and len(history[0]) < self.min_length:
            logits[:, list(self.eos)] = lowest
        if self.no_repeat_ngram:
            for row, tokens in enumerate(history):
                logits[row, _repeats(tokens, self.no_repeat_ngram)] = lowest
        if self.timestamps is not None:
            logits = self.timestamps.apply(logits, step, history)
        forced = self.forced_bos if step == 0 else self.forced_eos if last else None
        if forced is not None:  # after the others, as HF's processors run
            logits[:] = lowest
            logits[:, forced] = 0
        return logits


def _repeats(tokens: Sequence[int], n: int) -> list[int]:
    """The tokens that would repeat an n-gram of `tokens`: those that followed its last n - 1 tokens before."""
    if len(tokens) + 1 < n:
        return []
    tail = tuple(tokens[len(tokens) - n + 1:])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i: i + n - 1]) == tail]


class Seq2SeqGenerator:
    """encode_ids / encode_features, then generate_ids; `generate` for texts with the export's tokenizer."""

    def __init__(self, folder: str | Path, threads: int | None = None, spinning: bool = True) -> None:
        """`spinning=False`: ONNX Runtime's threads sleep while they wait (a busy shared CPU)."""
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        if self.manifest.get("encoder") is None:
            raise InputError(f"{self.folder} is a decoder-only export: use kvforge.runtime.Generator")
        self.record = EncoderRecord.from_manifest(self.manifest["encoder"])
        self.layout = KVLayout.from_manifest(self.manifest)
        self.rules = DecodingRules.from_manifest(self.manifest)
        self.vocab_size = self.manifest["model"]["vocab_size"]
        self.sessions = {phase: open_session(self.folder, self.manifest, phase, ["CPUExecutionProvider"],
                                             device="cpu", threads=threads, spinning=spinning, sessions="separate")
                         for phase in (ENCODER, "prefill", "decode")}
        self.cache_dtype = np.dtype(self.layout.dtype)
        self._tokenizer: Any = None

    # -- the encoder ----------------------------------------------------------------------------------------
    def encode_ids(self, sources: Sequence[Sequence[int]]) -> Encoded:
        """Token id sources (each ending with its end token, as the tokenizer writes it), right-padded into one run."""
        if self.record.input != "ids":
            raise InputError("this export's encoder takes audio features (encode_features), not token ids")
        lens = [len(source) for source in sources]
        if not sources or min(lens) < 1:
            raise InputError("each source needs at least one token")
        if max(lens) > self.record.max_length:
            raise InputError(f"a source of {max(lens)} tokens is longer than the encoder's {self.record.max_length}")
        ids = np.zeros((len(sources), max(lens)), np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
        lengths = np.array(lens, np.int32)
        out = self.sessions[ENCODER].run(None, {ENCODER_INPUT_IDS: ids, ENCODER_LENS: lengths})
        return Encoded(cross=out[1:], lens=lengths)

    def encode_features(self, features: np.ndarray) -> Encoded:
        """Whisper's log-mel features [B, mel bins, frames] (runtime/media/log_mel.py) of one window each."""
        if self.record.input != "features":
            raise InputError("this export's encoder takes token ids (encode_ids), not audio features")
        bins, frames = self.record.features["feature_size"], self.record.features["nb_max_frames"]
        features = np.asarray(features, np.float32)
        if features.ndim != 3 or features.shape[1:] != (bins, frames):
            raise InputError(f"features must be [batch, {bins}, {frames}], got {list(features.shape)}")
        out = self.sessions[ENCODER].run(None, {INPUT_FEATURES: features})
        return Encoded(cross=out[1:], lens=np.full(features.shape[0], out[1].shape[2], np.int32))

    # -- the decoder ----------------------------------------------------------------------------------------
    def generate_ids(self, encoded: Encoded, max_new_tokens: int = MAX_NEW_TOKENS,
                     prompt: Sequence[int] | None = None, sampling: SamplingConfig | None = None,
                     rules: DecodingRules | None = None) -> list[list[int]]:
        """Each row's generated tokens (its end token kept, nothing after it). `prompt`: the decoder's first tokens
        (default: the decoder start token alone), the same for every row."""
        prompt = list(prompt) if prompt is not None else [self.record.decoder_start_token_id]
        rules = rules if rules is not None else self.rules
        limit = self.layout.max_capacity - len(prompt)
        if not 1 <= max_new_tokens <= limit:
            raise InputError(f"max_new_tokens must be 1..{limit} (the decoder's {self.layout.max_capacity} positions "
                             f"less the prompt's {len(prompt)}), got {max_new_tokens}")
        batch = len(encoded.lens)
        run = _DecoderRun(self, encoded, batch, len(prompt) + max_new_tokens)
        sampler = Sampler(sampling or SamplingConfig())
        logits = run.prefill(np.array([prompt] * batch, np.int64))
        tokens: list[list[int]] = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        history = [list(prompt) for _ in range(batch)]
        for step in range(max_new_tokens):
            picked = sampler(rules.apply(logits, step, history, last=step == max_new_tokens - 1))
            for row in range(batch):
                history[row].append(int(picked[row]))
            for row in np.flatnonzero(~done):
                tokens[row].append(int(picked[row]))
                done[row] = int(picked[row]) in rules.eos
            if done.all() or step == max_new_tokens - 1:
                break
            logits = run.decode(picked)
        return tokens

    def next_logits(self, encoded: Encoded, prompt: Sequence[int]) -> np.ndarray:
        """The logits [B, V] after the decoder reads `prompt` (Whisper's language detection reads them)."""
        return _DecoderRun(self, encoded, len(encoded.lens), len(prompt)).prefill(
            np.array([list(prompt)] * len(encoded.lens), np.int64))

    def teacher_forced_logits(self, encoded: Encoded, sequences: np.ndarray) -> np.ndarray:
        """The logits [B, S, V] at every position of decoder sequences [B, S] (start token first) read in one
        prefill: what a check of the decoder against a reference reads."""
        sequences = np.asarray(sequences, np.int64)
        run = _DecoderRun(self, encoded, sequences.shape[0], sequences.shape[1])
        return run.prefill_all(sequences)

    def generate(self, texts: Sequence[str], max_new_tokens: int = MAX_NEW_TOKENS,
                 sampling: SamplingConfig | None = None) -> list[str]:
        """Texts in, texts out through the export's tokenizer (tokenizer.json), special tokens dropped."""
        tokenizer = self.tokenizer()
        outputs = self.generate_ids(self.encode_ids([tokenizer.encode(text) for text in texts]), max_new_tokens,
                                    sampling=sampling)
        return [self.text(ids) for ids in outputs]

    def text(self, tokens: Sequence[int]) -> str:
        """A generated row's text through the export's tokenizer, its end token left out."""
        return self.tokenizer().decode([t for t in tokens if t not in self.rules.eos])

    def finish_reason(self, tokens: Sequence[int], max_new_tokens: int) -> str:
        """"stop" for a row that ended at an end token before its limit, else "length" (OpenAI's names)."""
        return "stop" if tokens and tokens[-1] in self.rules.eos and len(tokens) < max_new_tokens else "length"

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from kvforge.runtime.text.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.folder)
        return self._tokenizer


def bind_decoder_state(session: Any, past_lens: np.ndarray, lens: np.ndarray, cross: Sequence[np.ndarray],
                       cache: dict[tuple[str, int], np.ndarray]) -> Any:
    """An IO binding of a decoder graph over these arrays (views included), without copying them: past_lens, the
    encoder lengths, the cross keys and values (graph order) as inputs, each self cache buffer as both its past input
    and its present output (written in place)."""
    binding = session.io_binding()
    names = cross_names(len(cross) // 2)
    for name, array in ((PAST_LENS, past_lens), (ENCODER_LENS, lens), *zip(names, cross, strict=True)):
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    for (kind, layer), array in cache.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(cache_input(kind, layer), value)
        binding.bind_ortvalue_output(cache_output(kind, layer), value)
    return binding


class _DecoderRun:
    """One batch's decoder state: the self cache bound in place to both graphs, the cross keys and values and the
    encoder lengths bound once, the step's inputs as arrays the bindings wrap."""

    def __init__(self, generator: Seq2SeqGenerator, encoded: Encoded, batch: int, capacity: int) -> None:
        self.sessions, self.vocab = generator.sessions, generator.vocab_size
        layout = generator.layout
        self.past_lens = np.zeros(batch, np.int32)
        self.ids = np.zeros((batch, 1), np.int64)
        self.logits = np.zeros((batch, self.vocab), np.float32)
        shape = (batch, layout.num_kv_heads, capacity, layout.head_dim)
        self.cache = {(kind, layer): np.zeros(shape, generator.cache_dtype)
                      for layer in range(layout.num_layers) for kind in ("key", "value")}
        self.cross = [np.ascontiguousarray(value) for value in encoded.cross]
        self.lens = np.ascontiguousarray(encoded.lens, np.int32)
        # Bindings over these arrays: a step writes the arrays, nothing is bound again.
        self.bindings = {phase: bind_decoder_state(self.sessions[phase], self.past_lens, self.lens, self.cross,
                                                   self.cache) for phase in ("prefill", "decode")}
        self.step_ids = ort.OrtValue.ortvalue_from_numpy(self.ids)
        self.bindings["decode"].bind_ortvalue_input(INPUT_IDS, self.step_ids)
        self.bindings["decode"].bind_output(LOGITS, "cpu", 0, np.float32, list(self.logits.shape),
                                            self.logits.ctypes.data)

    def prefill(self, prompt: np.ndarray) -> np.ndarray:
        binding = self.bindings["prefill"]
        binding.bind_cpu_input(INPUT_IDS, prompt)
        index = np.full((prompt.shape[0], 1), prompt.shape[1] - 1, np.int64)
        binding.bind_cpu_input(LOGITS_INDEX, index)
        binding.bind_output(LOGITS, "cpu", 0, np.float32, [prompt.shape[0], 1, self.vocab], self.logits.ctypes.data)
        self.sessions["prefill"].run_with_iobinding(binding)
        self.past_lens += prompt.shape[1]
        return self.logits.copy()

    def prefill_all(self, sequences: np.ndarray) -> np.ndarray:
        batch, length = sequences.shape
        out = np.zeros((batch, length, self.vocab), np.float32)
        binding = self.bindings["prefill"]
        binding.bind_cpu_input(INPUT_IDS, sequences)
        binding.bind_cpu_input(LOGITS_INDEX, np.tile(np.arange(length, dtype=np.int64), (batch, 1)))
        binding.bind_output(LOGITS, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self.sessions["prefill"].run_with_iobinding(binding)
        return out

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        self.ids[:, 0] = tokens
        self.sessions["decode"].run_with_iobinding(self.bindings["decode"])
        self.past_lens += 1
        return self.logits.copy()
