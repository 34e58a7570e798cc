"""The step engine: one batch KV cache (a backend slot) and the rows in it, advanced by prefill, decode
and draft-verification steps. The Generator (one request, its rows placed at once) and the Scheduler
(requests joining and leaving a running batch) both drive it, so the token protocol, speculation and
the cache bookkeeping are written once, here and in runtime/drivers/rows.py.

    engine = StepEngine(backend, slot, pad_token_id, check_logits)
    engine.place(0, row, picker)                       # a Row (runtime/drivers/rows.py) at batch row 0
    step = engine.prefill([prompt])                    # every placed row from position 0
    step = engine.decode()                             # one token for every running row
    step = engine.verify({at: most_tokens})            # drafts from each row's proposer, verified in one call
    for accepted in step.positions: ...                # (batch row, Row, token, text delta, logprob) each

The engine never touches a buffer: cache rows move through the backend's row operations (`admit` copies
a row prefilled elsewhere into the batch, `compact` moves rows down). Finished rows stay where they are
until released: a decode step feeds them the pad token at a frozen `past_lens` (written, never read).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvforge.core.errors import BackendUnavailableError
from kvforge.runtime.backends.backend import Backend, Slot, supports_rows
from kvforge.runtime.controls.logprobs import TokenLogprob
from kvforge.runtime.controls.sampling import greedy as greedy_tokens
from kvforge.runtime.drivers.proposers import Draft, Proposer
from kvforge.runtime.drivers.rows import Picker, Row
from kvforge.runtime.drivers.verification import verify_row

# check(logits, step, greedy_picks=None) -> logits, raising NumericalError on NaN (Generator.check_logits)
Check = Callable[..., np.ndarray]


class Accepted(NamedTuple):
    at: int  # batch row
    row: Row
    token: int
    delta: str  # the text the token lets out ("" while held back, or without a detokenizer)
    logprob: TokenLogprob | None


@dataclass(slots=True)
class Step:
    """What one engine step produced: the tokens accepted at each position it emitted (a prefill or decode
    step emits one, a verification up to draft_len + 1), its raw logits (prefill and decode: [B, V], the
    backend's buffer, valid until the next run), and the tokens it drafted and had accepted."""

    positions: list[list[Accepted]] = field(default_factory=list)
    logits: np.ndarray | None = None
    drafted: int = 0
    accepted_drafts: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) of each verified draft
    drafts: dict[int, tuple[int, int]] = field(default_factory=dict)  # the same by batch row
    # (batch row, Row) of the rows whose controls failed picking this step (Row.fail): finished with
    # FinishReason.ERROR, without a token; a row that fails taking its token is in `positions`
    failed: list[tuple[int, Row]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.positions))


class StepEngine:
    def __init__(self, backend: Backend, slot: Slot, pad_token_id: int, check: Check) -> None:
        self.backend = backend
        self.slot = slot
        self.pad = pad_token_id
        self.check = check
        batch = slot.cache.batch
        self.rows: list[Row | None] = [None] * batch
        self.pickers: list[Picker | None] = [None] * batch
        self.proposers: list[Proposer | None] = [None] * batch  # speculative rows' (runtime/drivers/proposers.py)
        self.steps = 0  # graph runs after the prefill (decode steps and verifications)
        # Placed rows that pick through their Picker (sampling, controls, logprobs); while there are
        # none, a step is an argmax (the common greedy case, kept cheap: it runs once per token).
        self._picking = 0
        self._feed: dict[int, np.ndarray] = {}  # a decode step's token ids, one buffer per batch size
        # ort-cuda's greedy picks on the device (runtime/backends/device_pick.py): used while no row needs its
        # Picker and the caller keeps no logits; B token ids come back instead of [B, V] logits.
        self._device_greedy = bool(getattr(backend, "device_greedy", False))
        self._staging: Slot | None = None  # a one-row slot, for prompts prefilled alone (_prefill_alone)

    @property
    def cache(self) -> Any:
        return self.slot.cache

    # -- rows -------------------------------------------------------------------------------------
    def place(self, at: int, row: Row, picker: Picker, proposer: Proposer | None = None) -> None:
        if self.rows[at] is not None:
            self.release(at)
        self.rows[at], self.pickers[at], self.proposers[at] = row, picker, proposer
        self.cache.rope_deltas[at] = row.rope_delta
        self._picking += not _bare(row, picker)

    def release(self, at: int) -> Row | None:
        """Free batch row `at` (its positions are never read again)."""
        row, picker = self.rows[at], self.pickers[at]
        if row is not None:
            self._picking -= not _bare(row, picker)
        if self.proposers[at] is not None:
            self.proposers[at].release(at)
        self.rows[at], self.pickers[at], self.proposers[at] = None, None, None
        self.cache.past_lens[at] = 0
        self.cache.rope_deltas[at] = 0
        return row

    def free_rows(self) -> list[int]:
        return [at for at, row in enumerate(self.rows) if row is None]

    def running(self, upto: int | None = None) -> list[int]:
        """Batch rows (of the first `upto`) whose row has not finished."""
        rows = self.rows if upto is None else self.rows[:upto]
        return [at for at, row in enumerate(rows) if row is not None and row.stopper.reason is None]

    def any_running(self) -> bool:
        for row in self.rows:  # a plain loop: asked once per step, cheaper than any() over a generator
            if row is not None and row.stopper.reason is None:
                return True
        return False

    def admit(self, placements: Sequence[tuple[int, Row, Picker]], source: Slot, positions: int,
              logits: np.ndarray, proposer: Proposer | None = None, hidden: np.ndarray | None = None) -> Step:
        """Rows prefilled on row 0 of `source` (another slot of this backend, positions 0..positions-1):
        copy that row into each placement's batch row, place them (with `proposer` when they speculate; `hidden`:
        that prefill's target hidden states [1, S, Dt] when the proposer reads them), and pick their first
        tokens from the prefill's raw logits [V]."""
        for at, row, picker in placements:
            self.backend.copy_rows(source, 0, self.slot, at, positions)
            self.cache.past_lens[at] = positions
            self.place(at, row, picker, proposer)
        ats = [at for at, _, _ in placements]
        accepted, failed = self._pick_accept(ats, np.broadcast_to(logits, (len(ats), logits.shape[-1])), 0)
        if proposer is not None:
            rows = hidden if hidden is None else np.broadcast_to(hidden[:1], (self.cache.batch, *hidden.shape[1:]))
            self._observe({at: (0, positions) for at in ats}, rows)
        return Step([accepted], failed=failed)

    def compact(self) -> list[tuple[int, int]]:
        """Move the last occupied row into the first free row below it until the occupied rows are the
        first ones (their written positions and past_lens, through the backend); the (from, to) moves."""
        moves = []
        past_lens = self.cache.past_lens
        while True:
            free = next((at for at, row in enumerate(self.rows) if row is None), None)
            last = max((at for at, row in enumerate(self.rows) if row is not None), default=-1)
            if free is None or free > last:
                return moves
            n = int(past_lens[last])
            self.backend.copy_rows(self.slot, last, self.slot, free, n)
            past_lens[free], past_lens[last] = n, 0
            deltas = self.cache.rope_deltas
            deltas[free], deltas[last] = deltas[last], 0
            self.rows[free], self.pickers[free] = self.rows[last], self.pickers[last]
            self.proposers[free] = self.proposers[last]
            if self.proposers[free] is not None:
                self.proposers[free].move(last, free)
            self.rows[last], self.pickers[last], self.proposers[last] = None, None, None
            moves.append((last, free))

    # -- steps ------------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Step:
        """Every placed row's prompt (row b: prompts[b]) from position 0 in one call, right-padded; the
        logits at each prompt's last position give the rows their first tokens."""
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        self.cache.reset()
        if getattr(self.cache, "has_state", False) and len(set(lens.tolist())) > 1:
            logits = self.check(self._prefill_alone(prompts), 0)
        else:
            ids = np.full((len(prompts), int(lens.max())), self.pad, dtype=np.int64)
            for b, prompt in enumerate(prompts):
                ids[b, : len(prompt)] = prompt
            logits = self.check(self.backend.prefill(self.slot, ids, lens - 1, self._images(len(prompts)),
                                                     self._positions(len(prompts), ids.shape[1])), 0)
        self.cache.past_lens[:] = lens
        accepted, failed = self._pick_accept(range(len(prompts)), logits, 0)
        self._observe({b: (0, int(lens[b])) for b in range(len(prompts)) if self.proposers[b] is not None})
        return Step([accepted], logits, failed=failed)

    def _images(self, rows: int, first: int = 0) -> np.ndarray | None:
        """The image features of a prefill of rows first..first+rows-1: their prompt images', row after row
        (contract.IMAGE_FEATURES), or None when none has images."""
        features = [row.image_features for row in self.rows[first:first + rows]
                    if row is not None and row.image_features is not None]
        return np.concatenate(features) if features else None

    def _positions(self, rows: int, seq: int, first: int = 0) -> np.ndarray | None:
        """The M-RoPE positions [3, rows, seq] of a prefill of rows first..first+rows-1 from position 0: each row's
        prompt positions, a text row's (and the padding's) past_lens + t; None when no row has any."""
        placed = self.rows[first:first + rows]
        if all(row is None or row.positions is None for row in placed):
            return None
        out = np.broadcast_to(np.arange(seq, dtype=np.int64), (3, rows, seq)).copy()
        for b, row in enumerate(placed):
            if row is not None and row.positions is not None:
                out[:, b, : row.positions.shape[1]] = row.positions
        return out

    def _prefill_alone(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prompts of different lengths for a model with recurrent layers: right padding would run pad tokens
        through the shorter rows' states, so each row is prefilled alone on a one-row staging slot and its
        cache row (keys, values, states) copied into the batch. The rows' last-position logits [B, V]."""
        if not supports_rows(self.backend):
            raise BackendUnavailableError(f"backend {getattr(self.backend, 'name', '?')!r} cannot move cache rows, "
                                          "which prompts of different lengths need on a model with recurrent "
                                          "layers; send prompts of one length per call")
        if self._staging is None or self._staging.cache.capacity != self.cache.capacity:
            self._staging = self.backend.allocate(1, self.cache.capacity)
        staging, out = self._staging, []
        for b, prompt in enumerate(prompts):
            staging.cache.reset()  # position 0: the graph reads the row's states as zeros
            logits = self.backend.prefill(staging, np.asarray([prompt], dtype=np.int64),
                                          np.array([len(prompt) - 1], dtype=np.int64), self._images(1, b),
                                          self._positions(1, len(prompt), b))
            out.append(logits.copy())  # the slot's logits buffer, which the next row's run overwrites
            self.backend.copy_rows(staging, 0, self.slot, b, len(prompt))
        return np.concatenate(out, axis=0)

    def decode(self, view: Slot | None = None, keep_logits: bool = False, skip: Collection[int] = ()) -> Step:
        """One token for every running row of `view` (this slot, or one over its first rows: the
        scheduler's batch buckets); the others are fed the pad token at their frozen past_lens.
        `keep_logits`: the step's logits are wanted (Step.logits); otherwise a backend that picks greedy
        tokens on its device may leave them there (Step.logits is then None). `skip`: rows that take no token
        (the scheduler verifies them in calls of their own): fed the pad token at their past_lens, as frozen
        rows are (their next run rewrites that position)."""
        slot = view if view is not None else self.slot
        batch = slot.cache.batch
        feed = self._feed.get(batch)
        if feed is None:
            feed = self._feed[batch] = np.empty(batch, dtype=np.int64)
        running, occupied = [], []
        for at, row in enumerate(self.rows[:batch]):
            if row is not None and not (skip and at in skip):
                occupied.append(at)
                if row.stopper.reason is None:
                    running.append(at)
        mask = None
        if len(running) < batch:
            # numpy calls are kept off the all-running path: with caches cold from the graph run, each
            # costs microseconds, and a small model's whole step is tens of them.
            feed.fill(self.pad)
            mask = np.zeros(batch, dtype=bool)
            mask[running] = True
        for at in running:
            feed[at] = self.rows[at].tokens[-1]
        if self._device_greedy and not self._picking and not keep_logits:
            tokens, totals = self.backend.decode_greedy(slot, feed, mask)
            self._advance(slot, mask)
            self._observe_decode(running, slot)
            self.check(totals if len(occupied) == batch else totals[occupied], self.steps)
            return Step([self._accept_picked(occupied, tokens[occupied].tolist())])
        logits = self.backend.decode(slot, feed, mask)
        self._advance(slot, mask)
        self._observe_decode(running, slot)
        accepted, failed = self._pick_accept(occupied, logits if len(occupied) == batch else logits[occupied],
                                             self.steps)
        return Step([accepted], logits, failed=failed)

    def _observe_decode(self, running: list[int], slot: Slot) -> None:
        """Tell the speculative rows' proposers of the position a decode step kept (one per running row)."""
        kept = {at: (int(slot.cache.past_lens[at]) - 1, 1) for at in running if self.proposers[at] is not None}
        if kept:
            self._observe(kept, slot=slot)

    def _observe(self, kept: dict[int, tuple[int, int]], hidden: np.ndarray | None = None,
                 slot: Slot | None = None) -> None:
        """Each speculative row's proposer learns the positions the target kept ({at: (first, count)}), with the
        target's hidden states there when it reads them (the last run's, unless `hidden` is given)."""
        groups: dict[int, tuple[Proposer, dict[int, tuple[int, int]]]] = {}
        for at, span in kept.items():
            proposer = self.proposers[at]
            if proposer is not None:
                groups.setdefault(id(proposer), (proposer, {}))[1][at] = span
        for proposer, spans in groups.values():
            states = hidden
            if states is None and proposer.needs_hidden:
                states = self._hidden(slot if slot is not None else self.slot)
            proposer.observe(self, spans, states)

    def _hidden(self, slot: Slot) -> np.ndarray:
        """The target's hidden states of `slot`'s last run by batch row (a one-row view's at its batch row)."""
        states = self.backend.target_hidden(slot)
        base = getattr(slot.cache, "row_offset", 0)
        if not base:
            return states
        rows = np.zeros((base + len(states), *states.shape[1:]), dtype=states.dtype)
        rows[base:] = states
        return rows

    def _advance(self, slot: Slot, mask: np.ndarray | None) -> None:
        if mask is None:
            slot.cache.past_lens += 1
        else:
            slot.cache.past_lens[mask] += 1
        self.steps += 1

    def verify(self, wants: dict[int, int], view: Slot | None = None) -> Step | None:
        """Speculation's step: each row of `wants` ({batch row: most tokens to draft}, running rows with a
        proposer) is fed its last token and its proposer's draft in one prefill call at its past_lens, and keeps
        what runtime/controls/acceptance.py accepts plus the target's own next token; the other running rows of
        the view take one token in the same call. Positions written beyond what a row keeps are rewritten
        before they are read. None when no row has a draft (then a plain decode step runs). `view` may also be
        a backend's one-row view of batch row `view.cache.row_offset` (backend.row_view)."""
        slot = view if view is not None else self.slot
        batch = slot.cache.batch
        base = getattr(slot.cache, "row_offset", 0)  # the view's row 0 is batch row `base`
        running = [at for at in self.running(base + batch) if at >= base]
        drafts = self._drafts(wants, running)
        if not drafts:
            return None
        width = 1 + max(len(d.tokens) for d in drafts.values())
        block = np.full((batch, width), self.pad, dtype=np.int64)
        for at in running:
            block[at - base, 0] = self.rows[at].tokens[-1]
            draft = drafts.get(at)
            if draft is not None:
                block[at - base, 1: 1 + len(draft.tokens)] = draft.tokens
        first = slot.cache.past_lens.copy()
        index = np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width))
        self.steps += 1
        logits = self.check(self.backend.prefill(slot, block, index), self.steps)
        step = Step()
        rows_kept = self._keep_greedy(running, drafts, logits, step, base) if not self._picking \
            else self._keep_picked(running, drafts, logits, step, base)
        slot.cache.past_lens[[at - base for at in running]] += [rows_kept[at] for at in running]
        self._observe({at: (int(first[at - base]), rows_kept[at]) for at in running
                       if self.proposers[at] is not None}, slot=slot)
        return step

    def _drafts(self, wants: dict[int, int], running: list[int]) -> dict[int, Draft]:
        """The non-empty drafts of the running rows in `wants`, asked of each proposer once for all its rows."""
        live = set(running)
        groups: dict[int, tuple[Proposer, dict[int, int]]] = {}
        for at, most in wants.items():
            proposer = self.proposers[at]
            if at in live and most >= 1 and proposer is not None:
                groups.setdefault(id(proposer), (proposer, {}))[1][at] = most
        drafts: dict[int, Draft] = {}
        for proposer, asked in groups.values():
            drafts.update((at, draft) for at, draft in proposer.propose(self, asked).items() if len(draft.tokens))
        return drafts

    def _keep_greedy(self, running: list[int], drafts: dict[int, Draft], logits: np.ndarray,
                     step: Step, base: int = 0) -> dict[int, int]:
        """Bare greedy rows: each keeps its draft's prefix the argmax agrees with and the argmax after it
        (logits[at - base] is batch row at's)."""
        picked = greedy_tokens(logits)
        kept = {}
        for at in running:
            draft = drafts.get(at)
            n = 0
            if draft is not None:
                while n < len(draft.tokens) and picked[at - base, n] == draft.tokens[n]:
                    n += 1
                step.drafted += len(draft.tokens)
                step.accepted_drafts += n
                step.runs.append((len(draft.tokens), n))
                step.drafts[at] = step.runs[-1]
            kept[at] = n + 1
        for j in range(max(kept.values(), default=0)):
            accepting = [at for at in running if not self.rows[at].finished and j < kept[at]]
            if accepting:
                step.positions.append([self._accept(at, int(picked[at - base, j]), None) for at in accepting])
        return kept

    def _keep_picked(self, running: list[int], drafts: dict[int, Draft], logits: np.ndarray,
                     step: Step, base: int = 0) -> dict[int, int]:
        """Rows that pick through their Picker, verified position by position (runtime/drivers/verification.py)."""
        kept: dict[int, int] = {}
        for at in running:
            row, draft = self.rows[at], drafts.get(at)
            tokens, accepted = verify_row(row, self.pickers[at], logits[at - base], draft or _NO_DRAFT,
                                          self.rng_of(at))
            if not tokens and row.finished:
                step.failed.append((at, row))
            if draft is not None:
                step.drafted += len(draft.tokens)
                step.accepted_drafts += accepted
                step.runs.append((len(draft.tokens), accepted))
                step.drafts[at] = step.runs[-1]
            kept[at] = max(len(tokens), 1)
            for j, token in enumerate(tokens):
                if len(step.positions) <= j:
                    step.positions.append([])
                step.positions[j].append(Accepted(at, row, token.token, token.delta, token.logprob))
        return kept

    def rng_of(self, at: int) -> np.random.Generator:
        """The random stream row `at` draws from: its own (n > 1 choices), else its request's."""
        picker = self.pickers[at]
        sampler = picker.sampler
        if sampler.row_rngs is None:
            return sampler.rng
        members = [b for b, other in enumerate(self.pickers) if other is picker]
        return sampler.row_rngs[members.index(at)]

    # -- the token protocol -----------------------------------------------------------------------
    def _pick_accept(self, ats: Sequence[int], logits: np.ndarray,
                     step: int) -> tuple[list[Accepted], list[tuple[int, Row]]]:
        """Pick the next token of the rows at batch rows `ats` (logits[i] is ats[i]'s raw logits) and
        accept it for those still running. Rows pick with their request's Picker, a block per picker.
        Also returns the rows whose controls failed while picking (they end without a token)."""
        ats = list(ats)
        if not self._picking:
            picked = greedy_tokens(logits).tolist()
            self.check(logits, step, picked)  # argmax picks a row's first NaN: the picked logits tell
            return self._accept_picked(ats, picked), []
        rows = [self.rows[at] for at in ats]
        pickers = [self.pickers[at] for at in ats]
        self.check(logits, step)
        out = []
        groups: dict[int, list[int]] = {}
        for i, picker in enumerate(pickers):
            groups.setdefault(id(picker), []).append(i)
        failed = []
        for members in groups.values():
            block = logits if len(members) == len(ats) else logits[members]
            running = [i for i in members if not rows[i].finished]
            tokens, logprobs = pickers[members[0]].pick(block, [rows[i] for i in members])
            for k, i in enumerate(members):
                if not rows[i].finished:
                    out.append(self._accept(ats[i], int(tokens[k]), logprobs[k] if logprobs else None))
                elif i in running:  # running before this pick: its controls failed
                    failed.append((ats[i], rows[i]))
        out.sort(key=lambda accepted: accepted.at)
        return out, failed

    def _accept_picked(self, ats: Sequence[int], picked: list[int]) -> list[Accepted]:
        """Bare-greedy rows at batch rows `ats` take their picked tokens (picked[i] is ats[i]'s), if still running."""
        out = []
        for at, token in zip(ats, picked, strict=True):
            row = self.rows[at]
            if row.stopper.reason is None:
                out.append(Accepted(at, row, token, row.accept(token), None))
        return out

    def _accept(self, at: int, token: int, logprob: TokenLogprob | None) -> Accepted:
        row = self.rows[at]
        return Accepted(at, row, token, row.accept(token, logprob), logprob)


_NO_DRAFT = Draft(np.empty(0, dtype=np.int64))


def _bare(row: Row, picker: Picker) -> bool:
    """Whether the row's next token is the argmax of its raw logits, with nothing else to compute."""
    return picker.bare_greedy and row.controls is None
