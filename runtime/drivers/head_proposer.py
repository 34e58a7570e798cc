"""The head proposer (methods `eagle` and `mtp`): the export's speculation head (draft.onnx, an EAGLE-3 head or
the checkpoint's MTP layer) drafts from the target's hidden states (runtime/drivers/proposers.py's interface).

The head keeps a KV row per batch row (runtime/backends/head_runner.py). Its cached position p holds (token p + 1,
the target's hidden state at p) and predicts token p + 2. Per row the proposer remembers `valid`, the head
positions cached from verified context, and the target hidden states of the kept positions it has not fed yet
(`pending`, from `observe`). A proposal:

1. catches up: the pending positions in one call at past_lens = valid (input_ids: the context tokens p + 1,
   target_hidden: the stored states, draft_hidden: zeros); the last position's logits give draft token 1;
2. chains: one position per call, fed the token just drafted, its previous hidden_out as draft_hidden and zeros as
   target_hidden, until the row has the tokens it asked for.

Then `valid` counts the caught-up positions only: the chained ones are rewritten by the next catch-up (rows roll
back by not counting positions, as the target's do). Rows are batched into each call; a row that feeds fewer
positions is padded, and its padding lands beyond its valid length, which nothing reads before it is rewritten.
The head cache has one position more than the target's, so even a full row has room for a call's padding.

Greedy rows draft the argmax mapped through token_map; sampling rows draw from the head's distribution under
the row's temperature / top-k / top-p / min-p (the target's rule, runtime/controls/acceptance.py) with their own
seeded stream, and return that distribution over the target vocabulary for the rejection rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.core.targets import Target
from kvforge.runtime.backends.head_runner import HeadRunner, HeadSlot
from kvforge.runtime.backends.target_hidden import refuse_heads
from kvforge.runtime.controls.acceptance import draw, target_distribution
from kvforge.runtime.drivers.proposers import Draft, EngineView, context

if TYPE_CHECKING:
    from kvforge.runtime.drivers.rows import Row

METHODS = {"eagle3": "eagle", "mtp": "mtp"}  # the draft record's kind -> the speculation method


@dataclass
class HeadRow:
    """What the head holds of one batch row."""

    row: Row  # the row it was built for: a new row placed at the batch row starts afresh
    valid: int = 0  # head positions 0..valid-1 are cached from verified context
    pending: list[np.ndarray] = field(default_factory=list)  # target hidden states of positions valid.., in order
    rng: np.random.Generator | None = None

    @property
    def waiting(self) -> int:
        return sum(len(block) for block in self.pending)


HEAD_NAMES = {"eagle": "EAGLE-3 head", "mtp": "MTP layer"}
HOW = {"eagle": "export with --eagle HEAD_DIR (an EAGLE-3 head trained for this model)",
       "mtp": "export a checkpoint that ships one (DeepSeek-V3, GLM-4.5, Qwen3-Next) without --no-mtp"}


def check_head(manifest: dict[str, Any], method: str, where: str) -> None:
    """InputError when the export does not carry the head `method` ("eagle" / "mtp") speculates with."""
    record = manifest.get("draft")
    have = METHODS.get(record.get("kind")) if isinstance(record, dict) else None
    if have == method:
        return
    if have is not None:
        raise InputError(f"{where}: this export carries no {HEAD_NAMES[method]} but an {HEAD_NAMES[have]}; speculate "
                         f"with method {have}")
    raise InputError(f"{where}: this export carries no {HEAD_NAMES[method]}; {HOW[method]}")


def export_head(export: Any, method: str) -> HeadRunner:
    """The head of a LoadedExport for `method`, on its backend's device (InputError where there is none)."""
    check_head(export.manifest, method, f"speculate={method!r}")
    return open_head(export.folder, export.manifest, export.backend, getattr(export.backend, "threads", None),
                     export.target)


def open_head(folder: str | Path, manifest: dict[str, Any], backend: Any, threads: int | None = None,
              target: Target | None = None) -> HeadRunner:
    """The export's head on the device of the target's `backend` (BackendUnavailableError where it runs none).
    `target`: the manifest's, where the caller resolved it already (LoadedExport.target)."""
    refuse_heads(backend)
    # spinning off: a head's threads spinning between its runs would hold the cores the target's steps need
    # (runtime/drivers/speculation_checks.py, open_draft)
    return HeadRunner(folder, manifest, device=getattr(backend, "device", "cpu"),
                      device_id=getattr(backend, "device_id", 0), threads=threads, spinning=False, target=target)


class HeadProposer:
    """Drafts with a speculation head for the rows of one engine (it holds their head KV rows)."""

    needs_hidden = True

    def __init__(self, runner: HeadRunner) -> None:
        self.runner = runner
        self.method = METHODS[runner.kind]
        self.slot: HeadSlot | None = None
        self.rows: dict[int, HeadRow] = {}

    # -- what the target kept ----------------------------------------------------------------------
    def observe(self, engine: EngineView, kept: Mapping[int, tuple[int, int]], hidden: np.ndarray | None) -> None:
        if hidden is None:
            raise InputError("the head proposer reads the target's hidden states; the engine passed none")
        for at, (first, count) in kept.items():
            state = self._row(engine, at)
            end = state.valid + state.waiting
            if first <= state.valid:  # at (after a proposal: its chained positions go) or before what is cached
                state.valid, state.pending = first, []
            elif first < end:  # the target rewound into what is pending
                state.pending = _take(state.pending, first - state.valid)
            elif first > end:
                # Positions the head never saw (a prefix reused from elsewhere): its rows there are stale, so its
                # drafts are weaker, never wrong (the target verifies them); it goes on from `first`.
                state.valid, state.pending = first, []
            if count > 0:
                state.pending.append(np.array(hidden[at, :count]))

    def _row(self, engine: EngineView, at: int) -> HeadRow:
        state = self.rows.get(at)
        if state is None or state.row is not engine.rows[at]:
            state = self.rows[at] = HeadRow(engine.rows[at])
        return state

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, engine: EngineView, wants: Mapping[int, int]) -> dict[int, Draft]:
        slot = self._slot(engine)
        ats = sorted(at for at, most in wants.items() if most >= 1 and self._ready(engine, at))
        if not ats:
            return {}
        first, rows = ats[0], ats[-1] + 1 - ats[0]  # the block of batch rows each call covers
        cur = np.array([self._valid(engine, at) for at in range(first, first + rows)], dtype=np.int64)
        logits, hidden = self._catch_up(engine, slot, ats, first, cur)
        tokens: dict[int, list[int]] = {at: [] for at in ats}
        probs: dict[int, list[np.ndarray]] = {at: [] for at in ats if not self._greedy(engine, at)}
        live = list(ats)
        while live:
            for at in live:
                tokens[at].append(self._pick(engine, at, logits[at], probs))
            live = [at for at in live if len(tokens[at]) < wants[at] and cur[at - first] + 1 <= slot.cache.capacity]
            if not live:
                break
            logits, hidden = self._chain(slot, live, tokens, hidden, first, cur)
        return {at: Draft(np.array(tokens[at], dtype=np.int64), np.stack(probs[at]) if at in probs else None)
                for at in ats}

    def _ready(self, engine: EngineView, at: int) -> bool:
        """Whether row `at` can draft: it has pending positions, and the context holds the token after each."""
        state = self.rows.get(at)
        if state is None or state.row is not engine.rows[at] or not state.waiting:
            return False
        row = state.row
        return len(row.prompt) + len(row.tokens) > state.valid + state.waiting

    def _valid(self, engine: EngineView, at: int) -> int:
        """Where a call starts writing row `at`: after its valid positions (a row the head does not hold: 0)."""
        state = self.rows.get(at)
        return state.valid if state is not None and state.row is engine.rows[at] else 0

    def _catch_up(self, engine: EngineView, slot: HeadSlot, ats: list[int], first: int,
                  cur: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Feed every row of `ats` its pending positions; each row's logits [Vd] and hidden_out [H] at its last.
        Calls of S positions each, S no more than every row of the block has room for (a nearly full row
        splits the catch-up into several calls)."""
        runner, capacity = self.runner, slot.cache.capacity
        feeds = {at: (context(engine, at), np.concatenate(self.rows[at].pending)) for at in ats}
        fed = dict.fromkeys(ats, 0)
        last_logits: dict[int, np.ndarray] = {}
        last_hidden: dict[int, np.ndarray] = {}
        rows = len(cur)
        while any(fed[at] < len(feeds[at][1]) for at in ats):
            seq = min(max(len(feeds[at][1]) - fed[at] for at in ats), int(capacity - cur.max()))
            ids = np.zeros((rows, seq), np.int64)
            target = np.zeros((rows, seq, runner.target_width), np.float32)
            for at in ats:
                ctx, states = feeds[at]
                n = min(seq, len(states) - fed[at])
                start = self.rows[at].valid + fed[at]  # head position = context position
                ids[at - first, :n] = ctx[start + 1: start + 1 + n]
                target[at - first, :n] = states[fed[at]: fed[at] + n]
            active = [at - first for at in ats if fed[at] < len(feeds[at][1])]
            logits, hidden = runner.run(slot, ids, target, np.zeros((rows, seq, runner.width), np.float32), cur,
                                        first=first, active=active)
            for at in ats:
                n = min(seq, len(feeds[at][1]) - fed[at])
                if n > 0:
                    fed[at] += n
                    cur[at - first] += n
                    if fed[at] == len(feeds[at][1]):
                        last_logits[at], last_hidden[at] = logits[at - first, n - 1], hidden[at - first, n - 1]
        for at in ats:
            state = self.rows[at]
            state.valid, state.pending = state.valid + fed[at], []
        return last_logits, last_hidden

    def _chain(self, slot: HeadSlot, live: list[int], tokens: dict[int, list[int]], hidden: dict[int, np.ndarray],
               first: int, cur: np.ndarray) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """One position per live row: its last drafted token with its previous hidden_out; the next logits."""
        runner, rows = self.runner, len(cur)
        ids = np.zeros((rows, 1), np.int64)
        own = np.zeros((rows, 1, runner.width), np.float32)
        for at in live:
            ids[at - first, 0] = tokens[at][-1]
            own[at - first, 0] = hidden[at]
        logits, out = runner.run(slot, ids, np.zeros((rows, 1, runner.target_width), np.float32), own, cur,
                                 first=first, active=[at - first for at in live])
        for at in live:
            cur[at - first] += 1
        return ({at: logits[at - first, 0] for at in live}, {at: out[at - first, 0] for at in live})

    def _greedy(self, engine: EngineView, at: int) -> bool:
        picker = engine.pickers[at]
        return picker is None or picker.sampler.config.greedy

    def _pick(self, engine: EngineView, at: int, logits: np.ndarray, probs: dict[int, list[np.ndarray]]) -> int:
        """Row `at`'s next drafted token (a target id) from the head's logits [Vd]: the argmax, or a draw from the
        distribution the row's sampling settings make of them (kept over the target vocabulary in `probs`)."""
        token_map = self.runner.token_map
        if at not in probs:
            return int(token_map[int(logits.argmax())])
        config = engine.pickers[at].sampler.config
        state = self.rows[at]
        if state.rng is None:
            # A seeded row drafts reproducibly, on a stream of its own: a child of the row's acceptance stream
            # (spawning draws nothing from it), so rows sharing a request's stream draft independently.
            state.rng = engine.rng_of(at).spawn(1)[0]
        q = target_distribution(logits, config)
        full = np.zeros(self.runner.vocab_size, dtype=np.float64)
        full[token_map] = q
        probs[at].append(full)
        return int(token_map[draw(q, state.rng)])

    # -- the head's cache ------------------------------------------------------------------------
    def _slot(self, engine: EngineView) -> HeadSlot:
        """The head cache for the engine's batch and capacity (+1: room for a full row's padding); a new one,
        with the rows the head holds copied over, when the engine's changed."""
        batch, capacity = engine.slot.cache.batch, engine.slot.cache.capacity + 1
        old = self.slot
        if old is not None and (old.cache.batch, old.cache.capacity) == (batch, capacity):
            return old
        self.slot = self.runner.allocate(batch, capacity)
        if old is not None:
            for at, state in list(self.rows.items()):
                if at < batch and state.valid <= capacity:
                    self.runner.copy_rows(old, at, self.slot, at, state.valid)
                else:
                    del self.rows[at]
        return self.slot

    def release(self, at: int) -> None:
        self.rows.pop(at, None)

    def move(self, src: int, dst: int) -> None:
        state = self.rows.pop(src, None)
        self.rows.pop(dst, None)
        if state is None:
            return
        if self.slot is not None and state.valid:
            self.runner.copy_rows(self.slot, src, self.slot, dst, state.valid)
        self.rows[dst] = state


def _take(blocks: list[np.ndarray], count: int) -> list[np.ndarray]:
    """The first `count` rows of a list of [n, Dt] blocks, as a list of blocks."""
    out, left = [], count
    for block in blocks:
        if left <= 0:
            break
        out.append(block[:left])
        left -= len(out[-1])
    return out
