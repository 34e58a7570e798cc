"""A fake backend for runtime tests: a tiny deterministic numpy language model behind the `Backend`
protocol of runtime/backends/backend.py, over a real per-row KV cache, so that the Generator, StepEngine,
Scheduler and GenerationService run in milliseconds without an export (issue 45).

    folder = write_export(tmp_path)                    # kvforge.json, tokenizer.json, placeholder graphs
    generator = make_generator(folder)                 # Generator(folder, backend=FakeBackend(...))
    model = generator.backend.model
    assert generator.generate([p], max_new_tokens=8, ignore_eos=True).tokens[0] == model.greedy(p, 8)

The model: per layer, a token's cache entry is key = E_l[token] and value = tanh(M_l @ value_prev +
E_l[token]) (value_prev: the previous position's value, zeros at position 0); the logits at a position
are, summed over layers, U_l (q + attention(q, keys[:p+1], values[:p+1])) with q the position's value.
So a step's logits depend on every cached position of its row: a row copied wrong, a past_lens off by
one or a position left stale changes them. Positions never written hold NaN, so a read of one ends in
NumericalError rather than a plausible token. Only elementwise numpy (no BLAS) is used, so the
backend's results and the reference loop (`FakeModel.greedy`, `FakeModel.logits`) agree bit for bit.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvforge.core.contract import KVLayout, ModelSpec, capacity_buckets
from kvforge.core.errors import InputError, KvforgeError
from kvforge.core.manifest import compose, io_spec, load_manifest, write_manifest
from kvforge.core.targets import get_target
from kvforge.runtime.backends.backend import Limits
from kvforge.runtime.backends.kv_cache import CacheState, check_row_arrays

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Once upon a time a small model said what its weights made "
    "likely. Prefill reads the prompt; decode adds one token per step. Hello, world! 0 1 2 3 4 5 6 7 8 9. "
    "a b c a b c; {\"name\": \"x\", \"age\": 3} [1, 2, 3] true false null"
)


# -- the model -------------------------------------------------------------------------------------
class FakeModel:
    """Seeded weights and the per-position maths shared by the backend and the reference loop."""

    def __init__(self, vocab_size: int, num_layers: int = 2, head_dim: int = 8, seed: int = 0,
                 favour: int | None = None) -> None:
        """`favour`: a token whose logit gets +100 everywhere (greedy then always picks it)."""
        rng = np.random.default_rng(seed)
        self.vocab_size, self.num_layers, self.head_dim = vocab_size, num_layers, head_dim
        f32 = np.float32
        self.embed = rng.standard_normal((num_layers, vocab_size, head_dim)).astype(f32)
        self.mix = (rng.standard_normal((num_layers, head_dim, head_dim)) / np.sqrt(head_dim)).astype(f32)
        self.out = rng.standard_normal((num_layers, vocab_size, head_dim)).astype(f32)  # U_l, row per token
        self.bias = np.zeros(vocab_size, f32)
        if favour is not None:
            self.bias[favour] = 100.0

    def entry(self, layer: int, token: int, previous: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(key, value) of `token` at a position whose previous value is `previous` (None: position 0)."""
        key = self.embed[layer, token]
        mixed = (self.mix[layer] * previous).sum(axis=1) if previous is not None else np.zeros_like(key)
        return key, np.tanh(mixed + key)

    def readout(self, keys: list[np.ndarray], values: list[np.ndarray]) -> np.ndarray:
        """Logits [V] of the last position, from each layer's keys / values [n, D] up to and including it."""
        logits = self.bias.copy()
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            q = v[-1]
            scores = (k * q).sum(axis=1) / np.float32(np.sqrt(self.head_dim))
            weights = np.exp(scores - scores.max())
            weights = weights / weights.sum()
            hidden = q + (weights[:, None] * v).sum(axis=0)
            logits = logits + (self.out[layer] * hidden).sum(axis=1)
        return logits.astype(np.float32)

    # -- the reference: a plain loop over token ids, no runtime, no cache object ---------------------
    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits [len(tokens), V]: row t predicts the token after tokens[:t+1]."""
        keys: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        values: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        return np.array([self._extend(keys, values, token) for token in tokens])

    def _extend(self, keys: list[list[np.ndarray]], values: list[list[np.ndarray]], token: int) -> np.ndarray:
        """Append `token`'s entries to the per-layer lists; the logits of its position."""
        for layer in range(self.num_layers):
            key, value = self.entry(layer, token, values[layer][-1] if values[layer] else None)
            keys[layer].append(key)
            values[layer].append(value)
        return self.readout([np.array(k) for k in keys], [np.array(v) for v in values])

    def greedy(self, prompt: list[int], n: int, stop: set[int] | None = None) -> list[int]:
        """The model's own greedy continuation of `prompt`, n tokens (or up to a token in `stop`)."""
        keys: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        values: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        for token in prompt:
            logits = self._extend(keys, values, token)
        out: list[int] = []
        while len(out) < n and not (out and stop is not None and out[-1] in stop):
            out.append(int(np.argmax(logits)))
            logits = self._extend(keys, values, out[-1])
        return out


# -- the cache and the backend ---------------------------------------------------------------------
class FakeCache(CacheState):
    """CacheState plus numpy key / value buffers [B, H, C, D] per layer (NaN until written)."""

    def __init__(self, layout: KVLayout, batch: int, capacity: int) -> None:
        super().__init__(layout.num_layers, batch, layout.num_kv_heads, capacity, layout.head_dim,
                         layout.dtype, layout.max_capacity)
        shape = (batch, layout.num_kv_heads, capacity, layout.head_dim)
        self.layers = [(np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32))
                       for _ in range(layout.num_layers)]

    def first_rows(self, rows: int) -> FakeCache:
        view = super().first_rows(rows)  # checks `rows`, shares past_lens
        assert isinstance(view, FakeCache)
        view.layers = [(k[:rows], v[:rows]) for k, v in self.layers]
        return view

    def row(self, at: int) -> FakeCache:
        """Row `at` alone, in place (as runtime/backends/row_view.py's): batch 1, `row_offset` at."""
        self.check_row(at, 0)
        view = copy.copy(self)
        view.shape = (1, *self.shape[1:])
        view.past_lens = self.past_lens[at: at + 1]
        view.row_offset = at
        view.layers = [(k[at: at + 1], v[at: at + 1]) for k, v in self.layers]
        return view


@dataclass
class FakeSlot:
    cache: FakeCache
    logits: np.ndarray  # [B, V]: returned by decode and one-position prefill, reused by the next run
    hidden: np.ndarray | None = None  # the last run's "hidden states" [B, S, D]: layer 0's values it wrote


class FakeBackend:
    """The Backend protocol over FakeModel. Limits come from the manifest, as OrtBackend's do, unless
    given (`max_batch`, `continue_batch`, `rollback`: to reach the runtime's refusals). `calls` records
    (phase, batch, width) of every run."""

    def __init__(self, manifest: dict[str, Any], model: FakeModel | None = None, max_batch: int | None = None,
                 continue_batch: int | None | str = "target", rollback: bool = True) -> None:
        self.name = "fake"
        self.layout = KVLayout.from_manifest(manifest)
        vocab = ModelSpec.from_manifest(manifest).vocab_size
        self.model = model or FakeModel(vocab, self.layout.num_layers, self.layout.head_dim)
        if self.model.vocab_size != vocab or self.model.num_layers != self.layout.num_layers:
            raise ValueError("the fake model does not match the manifest's vocabulary / layers")
        cap = self.layout.max_capacity
        # The target's continue_batch (1 for `ort`: GroupQueryAttention) unless one is given.
        rows = get_target(manifest["target"]).continue_batch if continue_batch == "target" else continue_batch
        self.limits = Limits(max_batch, cap, capacity_buckets(cap), rows, rollback)
        self.runs = {"prefill": 0, "decode": 0}
        self.allocations = 0
        self.calls: list[tuple[str, int, int]] = []

    def allocate(self, batch: int, capacity: int) -> FakeSlot:
        self.allocations += 1
        cache = FakeCache(self.layout, batch, capacity)
        cache.max_capacity = self.limits.max_capacity  # as OrtBackend.allocate: errors name the export's max
        return FakeSlot(cache, np.zeros((batch, self.model.vocab_size), np.float32))

    def _write(self, cache: FakeCache, b: int, pos: int, token: int) -> None:
        for layer, (keys, values) in enumerate(cache.layers):
            key, value = self.model.entry(layer, token, values[b, 0, pos - 1] if pos > 0 else None)
            keys[b, :, pos], values[b, :, pos] = key, value  # every head alike: H is only a shape here

    def _read(self, cache: FakeCache, b: int, pos: int) -> np.ndarray:
        return self.model.readout([k[b, 0, : pos + 1] for k, _ in cache.layers],
                                  [v[b, 0, : pos + 1] for _, v in cache.layers])

    def prefill(self, slot: FakeSlot, input_ids: np.ndarray, logits_index: np.ndarray,
                image_features: np.ndarray | None = None, positions: np.ndarray | None = None) -> np.ndarray:
        """input_ids [B, S] at each row's past_lens; logits_index [B] -> [B, V] (the slot's buffer), or
        [B, K] -> [B, K, V]. Writes positions past_lens[b] + 0..S-1 of every row, padding included."""
        assert image_features is None and positions is None, "the fake model takes no images"
        cache = slot.cache
        ids = np.asarray(input_ids, dtype=np.int64)
        cache.check_fits(ids.shape[1])
        index = np.asarray(logits_index, dtype=np.int64)
        per_row = index.ndim == 1
        index = index.reshape(index.shape[0], -1)
        if ids.shape[0] != cache.batch or index.shape[0] != cache.batch:
            raise KvforgeError(f"fake backend: {ids.shape[0]} rows of ids, {index.shape[0]} of logits_index "
                               f"for a slot of {cache.batch}")
        continuing = int((cache.past_lens > 0).sum()) if ids.shape[1] > 1 else 0
        if self.limits.continue_batch is not None and continuing > self.limits.continue_batch:
            # What GroupQueryAttention cannot do: a backend's declared limit the runtime must respect.
            raise KvforgeError(f"fake backend: {continuing} rows extended by {ids.shape[1]} tokens after a past; "
                               f"continue_batch is {self.limits.continue_batch}")
        out = np.empty((cache.batch, index.shape[1], self.model.vocab_size), np.float32)
        for b in range(cache.batch):
            start = int(cache.past_lens[b])
            for s, token in enumerate(ids[b].tolist()):
                self._write(cache, b, start + s, token)
            for k, i in enumerate(index[b].tolist()):
                out[b, k] = self._read(cache, b, start + i)
        self._count("prefill", ids.shape)
        slot.hidden = np.stack([self._values(cache, b, int(cache.past_lens[b]), ids.shape[1]) for b in range(cache.batch)])
        if index.shape[1] > 1:
            return out
        slot.logits[:] = out[:, 0]
        return slot.logits if per_row else slot.logits.reshape(cache.batch, 1, -1)

    def decode(self, slot: FakeSlot, token_ids: np.ndarray, running: np.ndarray | None = None) -> np.ndarray:
        """token_ids [B] -> [B, V] (the slot's buffer). Every row writes position past_lens[b]; only the
        `running` rows' capacity is checked (frozen rows at capacity write nothing and get zeros)."""
        cache = slot.cache
        cache.check_fits(1, running)
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist()
        for b, token in enumerate(tokens):
            pos = int(cache.past_lens[b])
            if pos >= cache.capacity:
                slot.logits[b] = 0.0
                continue
            self._write(cache, b, pos, token)
            slot.logits[b] = self._read(cache, b, pos)
        self._count("decode", (cache.batch, 1))
        slot.hidden = np.stack([self._values(cache, b, int(cache.past_lens[b]), 1) for b in range(cache.batch)])
        return slot.logits

    @staticmethod
    def _values(cache: FakeCache, b: int, start: int, count: int) -> np.ndarray:
        """Row b's layer-0 values at positions start..start+count-1 (zeros past the capacity) [count, D]."""
        values = cache.layers[0][1][b, 0, start: start + count]
        return np.concatenate([values, np.zeros((count - len(values), values.shape[-1]), np.float32)])

    def target_hidden(self, slot: FakeSlot) -> np.ndarray:
        """A speculation head's input (OrtBackend.target_hidden): here the values the slot's last run wrote,
        so that a test can check which positions a proposer was given."""
        if slot.hidden is None:
            raise ValueError("the slot has not run yet")
        return slot.hidden

    def _count(self, phase: str, shape: tuple[int, ...]) -> None:
        self.runs[phase] += 1
        self.calls.append((phase, int(shape[0]), int(shape[1])))

    # -- row operations ----------------------------------------------------------------------------
    def copy_rows(self, src: FakeSlot, row: int, dst: FakeSlot, dst_row: int, positions: int) -> None:
        src.cache.check_row(row, positions)
        dst.cache.check_row(dst_row, positions)
        if src.cache.shape[1:2] + src.cache.shape[3:] != dst.cache.shape[1:2] + dst.cache.shape[3:]:
            raise InputError("rows move only between KV caches of the same layout on the same device")
        for (sk, sv), (dk, dv) in zip(src.cache.layers, dst.cache.layers, strict=True):
            dk[dst_row, :, :positions] = sk[row, :, :positions]
            dv[dst_row, :, :positions] = sv[row, :, :positions]

    def read_rows(self, slot: FakeSlot, row: int, positions: int) -> list[tuple[np.ndarray, ...]]:
        slot.cache.check_row(row, positions)
        return [(k[row, :, :positions].copy(), v[row, :, :positions].copy()) for k, v in slot.cache.layers]

    def write_rows(self, slot: FakeSlot, row: int, layers: list[tuple[np.ndarray, ...]], positions: int) -> None:
        slot.cache.check_row(row, positions)
        check_row_arrays(slot.cache, layers, positions)
        for (k, v), (rk, rv) in zip(slot.cache.layers, layers, strict=True):
            k[row, :, :positions], v[row, :, :positions] = rk[:, :positions], rv[:, :positions]

    def view_rows(self, slot: FakeSlot, rows: int) -> FakeSlot:
        """The first `rows` rows in place (same buffers, same past_lens), with a logits buffer of its own."""
        return FakeSlot(slot.cache.first_rows(rows), np.zeros((rows, self.model.vocab_size), np.float32))

    def row_view(self, slot: FakeSlot, at: int) -> FakeSlot:
        """Row `at` of `slot` as a batch of 1 in place (OrtBackend.row_view)."""
        return FakeSlot(slot.cache.row(at), np.zeros((1, self.model.vocab_size), np.float32))


# -- an export folder without graphs ---------------------------------------------------------------
def build_tokenizer(size: int = 300) -> HFTokenizer:
    """Byte-level BPE trained on a few sentences (deterministic), <s> prepended to every encoding."""
    tokenizer = HFTokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tokenizer


def _graph(phase: str, layout: KVLayout, vocab: int) -> dict[str, Any]:
    """A manifest graph entry naming the contract's IO (runtime/backends/backend.py's graphs, never opened here)."""
    inputs = [io_spec("input_ids", "int64", ["batch", "seq"]), io_spec("past_lens", "int32", ["batch"])]
    if phase == "prefill":
        inputs.append(io_spec("logits_index", "int64", ["batch", "positions"]))
    shape = ["batch", layout.num_kv_heads, "capacity", layout.head_dim]
    inputs += [io_spec(name, "float32", shape) for name in layout.cache_inputs()]
    outputs = [io_spec("logits", "float32", ["batch", "positions", vocab])]
    outputs += [io_spec(name, "float32", shape) for name in layout.cache_outputs()]
    return {"file": f"{phase}.onnx", "inputs": inputs, "outputs": outputs}


def write_export(folder: Path, target: str = "onnx", max_capacity: int = 256, num_layers: int = 2,
                 head_dim: int = 8, eos: tuple[int, ...] = (EOS_ID,), generation: dict[str, Any] | None = None,
                 tokenizer: bool = True, chat_template: str | None = None) -> Path:
    """An export folder the runtime loads (checked by load_manifest): kvforge.json, tokenizer.json, the
    chat template if given, and placeholder graph / weight files (the fake backend never reads them).
    Vocabulary: the tokenizer's."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    blobs = {"prefill.onnx": b"fake prefill", "decode.onnx": b"fake decode", "model.weights": b"\0" * 16}
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    if tokenizer:
        blobs["tokenizer.json"] = tok.to_str().encode()
    if chat_template is not None:
        blobs["chat_template.jinja"] = chat_template.encode()
    for name, data in blobs.items():
        (folder / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    layout = KVLayout(num_layers, 1, head_dim, "float32", max_capacity)
    spec = ModelSpec(vocab_size=vocab, num_heads=1, bos_token_id=BOS_ID, eos_token_id=eos, pad_token_id=PAD_ID)
    manifest = compose(model=spec, kv_cache=layout, target=target, dtype="fp32",
                       graphs={phase: _graph(phase, layout, vocab) for phase in ("prefill", "decode")},
                       files=files, weights="model.weights",
                       chat_template="chat_template.jinja" if chat_template is not None else None,
                       **({"generation": generation} if generation is not None else {}))
    write_manifest(folder, manifest)
    return folder


def make_generator(folder: Path, model: FakeModel | None = None, favour: int | None = None,
                   **backend_options: Any) -> Any:
    """Generator(folder) on a FakeBackend (backend_options: FakeBackend's max_batch, continue_batch, rollback);
    `favour`: a model whose greedy choice is always that token (FakeModel's option)."""
    from kvforge.runtime import Generator

    manifest = load_manifest(folder)
    if favour is not None:
        model = FakeModel(ModelSpec.from_manifest(manifest).vocab_size, favour=favour)
    backend = FakeBackend(manifest, model, **backend_options)
    return Generator(folder, backend=backend)


def without_rows(backend: FakeBackend) -> Any:
    """A copy of `backend` lacking the row operations (a backend serving cannot use)."""
    bare = copy.copy(backend)
    for name in ("copy_rows", "read_rows", "write_rows", "view_rows", "row_view"):
        setattr(bare, name, None)
    return bare
