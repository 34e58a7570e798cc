"""Continuous batching for an encoder-decoder export: rows of different requests, with different encoder lengths,
decoded together, joining and leaving between steps.

`Seq2SeqBatcher.generate_ids` has the signature of `Seq2SeqGenerator.generate_ids` and may be called from many threads
at once: each caller encodes its sources itself (the encoder runs in the caller's thread) and hands the rows over;
one decoding thread runs every step for all the rows in flight and wakes each caller when its rows are done.

The rows in flight sit in slots 0..k-1 of preallocated arrays, each slot holding its own cross keys and values
(`[slots, H, W, D]`, W the longest encoder output admitted so far: shorter rows padded and masked by their
`encoder_lens`) and its self cache (`[slots, H, capacity, D]`, written in place). A new row is prefilled alone
through views of its slot; each step then decodes the k rows in one run through views of slots 0..k-1; a finished
row's slot is filled with the last row's (one row copied), so the rows in flight stay contiguous.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import INPUT_IDS, LOGITS, LOGITS_INDEX
from kvforge.core.errors import InputError, KvforgeError, QueueFullError
from kvforge.runtime.controls.sampling import Sampler, SamplingConfig
from kvforge.runtime.drivers.seq2seq import (
    MAX_NEW_TOKENS,
    DecodingRules,
    Encoded,
    Seq2SeqGenerator,
    bind_decoder_state,
)

KINDS = ("key", "value")


@dataclass
class _Row:
    cross: list[np.ndarray]  # [1, H, T, D] each, graph order
    prompt: list[int]
    max_new: int
    sampler: Sampler
    rules: DecodingRules
    tokens: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    @property
    def length(self) -> int:
        return self.cross[0].shape[2]


class Seq2SeqBatcher:
    """Up to `max_rows` rows decoded together (see the module docstring), up to `max_queue` more waiting (beyond:
    QueueFullError); `close()` stops the decoding thread."""

    def __init__(self, generator: Seq2SeqGenerator, max_rows: int = 8, max_queue: int = 64) -> None:
        for name, value in (("max_rows", max_rows), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self.generator, self.max_rows, self.max_queue = generator, max_rows, max_queue
        layout = generator.layout
        self.capacity = layout.max_capacity
        shape = (max_rows, layout.num_kv_heads, self.capacity, layout.head_dim)
        self.cache = {(kind, layer): np.zeros(shape, generator.cache_dtype)
                      for layer in range(layout.num_layers) for kind in KINDS}
        self.cross: list[np.ndarray] = []  # [max_rows, H, W, D] per name, made at the first row
        self.lens = np.zeros(max_rows, np.int32)
        self.past_lens = np.zeros(max_rows, np.int32)
        self.ids = np.zeros((max_rows, 1), np.int64)
        self.logits = np.zeros((max_rows, generator.vocab_size), np.float32)
        self.bound: dict[tuple[str, int, int], Any] = {}  # IO bindings by (phase, first slot, end slot)
        self.rows: list[_Row] = []  # in flight: row i in slot i
        self.waiting: list[_Row] = []
        self.wake = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="kvforge-seq2seq-batch", daemon=True)
        self.thread.start()

    # -- callers' side --------------------------------------------------------------------------------------
    def generate_ids(self, encoded: Encoded, max_new_tokens: int = MAX_NEW_TOKENS, prompt: Sequence[int] | None = None,
                     sampling: SamplingConfig | None = None, rules: DecodingRules | None = None) -> list[list[int]]:
        """As Seq2SeqGenerator.generate_ids; the rows decode beside other callers' rows."""
        prompt = list(prompt) if prompt is not None else [self.generator.record.decoder_start_token_id]
        limit = self.capacity - len(prompt)
        if not 1 <= max_new_tokens <= limit:
            raise InputError(f"max_new_tokens must be 1..{limit} (the decoder's {self.capacity} positions less the "
                             f"prompt's {len(prompt)}), got {max_new_tokens}")
        rows = [_Row([np.ascontiguousarray(c[r: r + 1, :, : int(encoded.lens[r])]) for c in encoded.cross], prompt,
                     max_new_tokens, Sampler(sampling or SamplingConfig()),
                     rules if rules is not None else self.generator.rules)
                for r in range(len(encoded.lens))]
        with self.wake:
            if self.closed:
                raise KvforgeError("the encoder-decoder batcher is closed")
            if len(self.waiting) + len(rows) > self.max_queue:
                raise QueueFullError(f"{len(self.waiting)} rows are already waiting (max_queue {self.max_queue})")
            self.waiting.extend(rows)
            self.wake.notify()
        for row in rows:
            row.done.wait()
            if row.error is not None:
                raise row.error
        return [row.tokens for row in rows]

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.thread.join(timeout=30)

    # -- the decoding thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.closed and not self.waiting and not self.rows:
                    self.wake.wait()
                if self.closed:
                    for row in [*self.waiting, *self.rows]:
                        row.error = KvforgeError("the encoder-decoder batcher was closed")
                        row.done.set()
                    return
                admitted = self.waiting[: self.max_rows - len(self.rows)]
                del self.waiting[: len(admitted)]
            try:
                self._step(admitted)
            except Exception as err:  # the rows in flight fail with it; the batcher goes on with the next ones
                for row in [*admitted, *self.rows]:
                    row.error = err
                    row.done.set()
                self.rows = [row for row in self.rows if not row.done.is_set()]

    def _step(self, admitted: list[_Row]) -> None:
        """Prefill the admitted rows one by one, pick every row's next token, then one decode run for the rest."""
        picked: dict[int, np.ndarray] = {}
        for row in admitted:
            slot = len(self.rows)
            self._place(row, slot)
            self.rows.append(row)
            picked[slot] = self._prefill(slot)
        for slot in range(len(self.rows) - 1, -1, -1):  # from the last: a finished row's slot takes the last row
            row = self.rows[slot]
            logits = picked[slot] if slot in picked else self.logits[slot: slot + 1].copy()
            step = len(row.tokens)
            history = [row.prompt + row.tokens]
            token = int(row.sampler(row.rules.apply(logits, step, history, last=step == row.max_new - 1))[0])
            row.tokens.append(token)
            self.ids[slot, 0] = token
            if token in row.rules.eos or len(row.tokens) == row.max_new:
                self._finish(slot)
        if self.rows:
            self._decode(len(self.rows))

    def _place(self, row: _Row, slot: int) -> None:
        """The row's cross keys and values into its slot (the arrays widened first when the row is longer)."""
        width = self.cross[0].shape[2] if self.cross else 0
        if row.length > width:
            wider = [np.zeros((self.max_rows, *c.shape[1:2], row.length, c.shape[3]), c.dtype) for c in row.cross]
            for old, new in zip(self.cross, wider, strict=False):
                new[:, :, :width] = old
            self.cross = wider
            self.bound.clear()  # the bindings held views of the replaced arrays
        for array, value in zip(self.cross, row.cross, strict=True):
            array[slot, :, : row.length] = value[0]
            array[slot, :, row.length:] = 0
        self.lens[slot], self.past_lens[slot] = row.length, 0

    def _binding(self, phase: str, rows: slice) -> Any:
        """A binding of `phase` over the slots `rows`: views of the arrays, so the run writes the caches in place;
        made once per phase and slot range (dropped when the cross arrays are widened, which replaces them)."""
        key = (phase, rows.start, rows.stop)
        if key not in self.bound:
            self.bound[key] = bind_decoder_state(self.generator.sessions[phase], self.past_lens[rows], self.lens[rows],
                                                 [array[rows] for array in self.cross],
                                                 {name: array[rows] for name, array in self.cache.items()})
            if phase == "decode":
                self.bound[key].bind_ortvalue_input(INPUT_IDS, ort.OrtValue.ortvalue_from_numpy(self.ids[rows]))
                self.bound[key].bind_output(LOGITS, "cpu", 0, np.float32, [rows.stop - rows.start,
                                                                          self.generator.vocab_size],
                                            self.logits.ctypes.data)
        return self.bound[key]

    def _prefill(self, slot: int) -> np.ndarray:
        row = self.rows[slot]
        binding = self._binding("prefill", slice(slot, slot + 1))
        binding.bind_cpu_input(INPUT_IDS, np.array([row.prompt], np.int64))
        binding.bind_cpu_input(LOGITS_INDEX, np.array([[len(row.prompt) - 1]], np.int64))
        out = np.zeros((1, 1, self.generator.vocab_size), np.float32)
        binding.bind_output(LOGITS, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        self.generator.sessions["prefill"].run_with_iobinding(binding)
        self.past_lens[slot] += len(row.prompt)
        return out[:, 0]

    def _decode(self, count: int) -> None:
        self.generator.sessions["decode"].run_with_iobinding(self._binding("decode", slice(0, count)))
        self.past_lens[:count] += 1

    def _finish(self, slot: int) -> None:
        """The row in `slot` is done: its caller woken, the last row moved into its slot."""
        self.rows[slot].done.set()
        last = len(self.rows) - 1
        if slot != last:
            for array in [*self.cache.values(), *self.cross, self.lens, self.past_lens, self.ids]:
                array[slot] = array[last]
            self.logits[slot] = self.logits[last]
            self.rows[slot] = self.rows[last]
        self.rows.pop()
