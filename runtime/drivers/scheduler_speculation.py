"""Speculative decoding in the continuous-batching Scheduler (runtime/drivers/scheduler.py).

Each request picks its proposer (runtime/drivers/proposers.py) by its `speculation.method`: prompt lookup, the
scheduler's draft export (`Scheduler(..., draft=DIR)`: one DraftModelProposer for the scheduler's engine, whose
KV rows follow the target's through admit, release and compaction), or the export's head (`eagle`, `mtp`:
one head proposer per method, fed the target's hidden states of every prefill chunk). A request that says
nothing takes the scheduler's default (`speculate=`, `draft_len=`); Speculation("off") opts out. Rows with and
without speculation, each with its own draft length, run in one batch:

- a target that extends any number of rows after a past (`onnx`: Limits.continue_batch None) verifies every
  speculative row's draft in one prefill call over the decode bucket, the plain rows taking their one token in
  the same call;
- the `ort` target (GroupQueryAttention: one row per such call) verifies each speculative row in a call of its
  own on a one-row view of its batch row (backend.row_view), then runs the plain rows' decode step, the
  verified rows frozen in it; a backend without row views speculates only for a request running alone.

With `adaptive` (the default) each row's draft length follows its acceptance (runtime/controls/speculate.py's
AdaptiveDraftLength, within 1..draft_len). Greedy rows give exactly their plain greedy tokens, sampled rows
the target's distribution (the rejection rule of runtime/controls/acceptance.py).

Stats (Scheduler.snapshot): draft_tokens / accepted_tokens, verify_steps (verification calls),
speculative_steps / speculative_tokens (target calls a speculative row took part in, and the tokens it got
from them: tokens per target step), drafted_at / accepted_at (per draft position 1..MAX_DRAFT_LEN: drafts
that reached it, and those kept through it).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError
from kvforge.runtime.controls.request import GenerationRequest, Speculation
from kvforge.runtime.controls.speculate import (
    DEFAULT_DRAFT_LEN,
    HEAD_METHODS,
    MAX_DRAFT_LEN,
    AdaptiveDraftLength,
)
from kvforge.runtime.drivers.draft_model import DraftModel
from kvforge.runtime.drivers.engine import Step, StepEngine
from kvforge.runtime.drivers.proposers import PROMPT_LOOKUP, Proposer

if TYPE_CHECKING:
    from kvforge.runtime.drivers.loaded_export import LoadedExport
    from kvforge.runtime.drivers.rows import Row

STATS = {"verify_steps": 0, "speculative_steps": 0, "speculative_tokens": 0}


class RowSpeculation:
    """One speculative row's settings: its proposer and draft length (adapted, or fixed)."""

    def __init__(self, speculation: Speculation, proposer: Proposer, adaptive: bool) -> None:
        self.speculation = speculation
        self.proposer = proposer
        self.length = AdaptiveDraftLength(speculation.draft_len) if adaptive else None
        self.counts = [0, 0, 0]  # drafted, accepted, verify steps: the row's Done reports them

    def most(self, row: Row, max_new_tokens: int) -> int:
        """How many tokens the row drafts this step (0: it takes one token, as a plain row)."""
        draft_len = self.length.length if self.length is not None else self.speculation.draft_len
        return row.room(draft_len, max_new_tokens)


class Speculator:
    """The scheduler's speculation: proposers by method, the per-request choice, the step plan and its stats."""

    def __init__(self, export: LoadedExport, engine: StepEngine, stats: dict[str, Any], speculate: str | None = None,
                 draft_len: int = DEFAULT_DRAFT_LEN, draft: DraftModel | str | Path | LoadedExport | None = None,
                 adaptive: bool = True) -> None:
        """`stats`: the scheduler's counters, which this adds to (STATS' keys, draft_tokens, accepted_tokens)."""
        if not isinstance(adaptive, bool):
            raise InputError(f"adaptive must be true or false, got {adaptive!r}")
        self.export, self.engine, self.backend = export, engine, engine.backend
        self.stats = stats
        stats.update(STATS)
        self.adaptive = adaptive
        self.default = Speculation(speculate, draft_len) if speculate is not None else None  # checks both
        if self.default is not None and not self.default.off:
            self.backend.limits.check_speculation(self.default)
        if draft is not None and not isinstance(draft, DraftModel):
            draft = DraftModel.open(draft, export)
        self.draft: DraftModel | None = draft
        self._proposers: dict[str, Proposer] = {"prompt-lookup": PROMPT_LOOKUP}
        if draft is not None:
            self._proposers["draft"] = draft.proposer()  # one for the engine: it keeps a KV row per batch row
        self._lock = threading.Lock()
        limit = self.backend.limits.continue_batch
        self.whole_view = limit is None or limit >= engine.cache.batch
        self.row_views = not self.whole_view and callable(getattr(self.backend, "row_view", None))
        self._views: dict[int, Any] = {}
        if self.default is not None and not self.default.off:
            self.proposer(self.default.method)  # a default that cannot run fails here, not at each request
        self.drafted_at = [0] * MAX_DRAFT_LEN
        self.accepted_at = [0] * MAX_DRAFT_LEN

    # -- per request -------------------------------------------------------------------------------
    def resolve(self, request: GenerationRequest) -> tuple[Speculation | None, Proposer | None]:
        """The request's speculation (its own, else the scheduler's default; None: it does not speculate) and
        its proposer. InputError for a method this scheduler cannot run."""
        speculation = request.speculation if request.speculation is not None else self.default
        if speculation is None or speculation.off:
            return None, None
        self.backend.limits.check_speculation(speculation)
        return speculation, self.proposer(speculation.method)

    def proposer(self, method: str) -> Proposer:
        with self._lock:
            proposer = self._proposers.get(method)
            if proposer is not None:
                return proposer
            if method == "draft":
                raise InputError("speculation method 'draft' needs a draft export: Scheduler(export, draft=DIR) "
                                 "(the server's --draft DIR)")
            if method not in HEAD_METHODS:
                raise InputError(f"unknown speculation method {method!r}")
            proposer = self._proposers[method] = _open_head(self.export, method)
            return proposer

    def rows(self, speculation: Speculation | None, proposer: Proposer | None, n: int) -> list[RowSpeculation | None]:
        """Each choice's RowSpeculation (None for all where the request does not speculate)."""
        if speculation is None or proposer is None:
            return [None] * n
        return [RowSpeculation(speculation, proposer, self.adaptive) for _ in range(n)]

    # -- one step ----------------------------------------------------------------------------------
    def wants(self, live: list[int]) -> dict[int, int]:
        """{batch row: most tokens to draft} of the live speculative rows that draft this step."""
        out = {}
        for at in live:
            row = self.engine.rows[at]
            spec = row.owner.speculation[row.index]
            if spec is not None:
                most = spec.most(row, row.owner.request.max_new_tokens)
                if most >= 1:
                    out[at] = most
        return out

    def steps(self, live: list[int], view: Any, deliver: Any) -> tuple[list[Step], set[int]] | None:
        """Run this step's verifications, each handed to `deliver(step)` as it ends; the steps and the rows they
        advanced (the rest take a plain decode step). None when no row speculates this step."""
        wants = self.wants(live)
        if not wants:
            return None
        if self.whole_view:
            # Every row of the bucket writes the verification's width from its past: it must fit the plain rows.
            past = self.engine.cache.past_lens
            room = self.engine.cache.capacity - 1 - max(int(past[at]) for at in live)
            wants = {at: min(most, room) for at, most in wants.items() if room >= 1}
            step = self._verify(wants, view, live) if wants else None
            if step is None:
                return None
            deliver(step)
            return [step], set(live)
        if not self.row_views and len(live) > 1:
            return None  # one row per call and no row views: speculate for a request running alone only
        done, advanced = [], set()
        for at, most in wants.items():
            step = self._verify({at: most}, self._row_view(at, view, live), [at])
            if step is not None:
                deliver(step)
                done.append(step)
                advanced.add(at)
        return done, advanced

    def _row_view(self, at: int, view: Any, live: list[int]) -> Any:
        if not self.row_views:  # alone, packed at row 0: the one-row bucket is its view
            return view
        slot = self._views.get(at)
        if slot is None:
            slot = self._views[at] = self.backend.row_view(self.engine.slot, at)
        return slot

    def _verify(self, wants: dict[int, int], view: Any, rows: list[int]) -> Step | None:
        speculative = [at for at in rows if self.engine.proposers[at] is not None]
        step = self.engine.verify(wants, view)
        if step is not None:
            self.count(step, speculative)
        return step

    def count(self, step: Step, speculative: list[int], verify: bool = True) -> None:
        """Add a step to the stats: its drafts per row (and each row's adaptive length), and the target call's
        share of the speculative rows that took part (`speculative`, batch rows taken before the step)."""
        stats = self.stats
        tokens = Counter(accepted.at for position in step.positions for accepted in position)
        stats["speculative_steps"] += len(speculative)
        stats["speculative_tokens"] += sum(tokens[at] for at in speculative)
        if not verify:
            return
        stats["verify_steps"] += 1
        stats["draft_tokens"] += step.drafted
        stats["accepted_tokens"] += step.accepted_drafts
        for at, (drafted, accepted) in step.drafts.items():
            for j in range(min(drafted, MAX_DRAFT_LEN)):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < accepted
            row = self.engine.rows[at]
            spec = row.owner.speculation[row.index] if row is not None else None
            if spec is None:
                continue
            spec.counts[0] += drafted
            spec.counts[1] += accepted
            spec.counts[2] += 1
            if spec.length is not None:
                spec.length.update(drafted, accepted)


def _open_head(export: LoadedExport, method: str) -> Proposer:
    """The export's speculation head as a proposer (runtime/drivers/head_proposer.py): InputError where the export
    has none, or one of another method."""
    from kvforge.runtime.drivers import head_proposer

    opener = getattr(head_proposer, "open_head_proposer", None)
    if opener is not None:
        return opener(export, method)
    record = export.manifest.get("draft")
    if record is None:
        raise InputError(f"speculation method {method!r} needs an export with a speculation head (draft.onnx); "
                         f"{export.folder} has none: export it with one, or speculate with 'prompt-lookup' or 'draft'")
    proposer = head_proposer.HeadProposer(head_proposer.open_head(export.folder, export.manifest, export.backend,
                                                                 target=export.target))
    if proposer.method != method:
        raise InputError(f"speculation method {method!r}: {export.folder}'s head is {proposer.method!r}")
    return proposer
