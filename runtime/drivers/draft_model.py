"""The draft-model proposer: a smaller export with the target's vocabulary (the target's own int4 export
included: self-speculation by quantisation) drafts greedily, or samples where the row samples.

The draft keeps its own KV rows in a slot of its backend, one batch row per target batch row. Per row it
remembers how many positions of the row's context its cache holds correctly (`valid`). A proposal feeds
the context tokens it has not seen (usually the last one or two) in one prefill call at `valid`, which
gives the first drafted token, then one decode step per further token. After verification the drafted
positions the target kept stay valid; the rest are rewritten by the next proposal (rows roll back by
not counting them, as the target's do).

    draft = DraftModel.open("smollm2-int4", target_export)     # checks the vocabularies first
    proposer = draft.proposer()                                  # one per engine (it holds rows)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.controls.acceptance import draw, target_distribution
from kvforge.runtime.controls.sampling import greedy as greedy_tokens
from kvforge.runtime.drivers.draft_checks import check_draft_pair
from kvforge.runtime.drivers.proposers import Draft, EngineView, context

if TYPE_CHECKING:
    from kvforge.runtime.drivers.loaded_export import LoadedExport


class DraftModel:
    """A loaded draft export checked against its target (runtime/drivers/draft_checks.py)."""

    def __init__(self, draft: LoadedExport, target: LoadedExport) -> None:
        check_draft_pair(draft, target)
        self.export = draft

    @classmethod
    def open(cls, folder: str | Path | LoadedExport, target: LoadedExport, **backend_options: Any) -> DraftModel:
        """The draft export at `folder` on the target's backend (its own options: threads, ...), checked against it."""
        from kvforge.runtime.drivers.loaded_export import LoadedExport
        from kvforge.runtime.drivers.speculation_checks import open_draft

        if isinstance(folder, LoadedExport):
            return cls(folder, target)
        return cls(open_draft(Path(folder), target, **backend_options), target)

    def proposer(self) -> DraftModelProposer:
        return DraftModelProposer(self.export)


class DraftModelProposer:
    method = "draft"
    needs_hidden = False

    def __init__(self, export: LoadedExport) -> None:
        self.export = export
        self.backend = export.backend
        self.slot: Any = None
        self.valid: dict[int, int] = {}  # batch row -> context positions the draft's cache holds correctly
        self.fed: dict[int, np.ndarray] = {}  # batch row -> the drafted tokens its cache holds past `valid`
        self.rngs: dict[int, np.random.Generator] = {}
        self.views: dict[int, Any] = {}  # batch row -> its one-row view (backend.row_view), where used

    def _slot(self, engine: EngineView) -> Any:
        batch, capacity = engine.slot.cache.batch, engine.slot.cache.capacity
        if self.slot is None or self.slot.cache.batch != batch or self.slot.cache.capacity != capacity:
            if self.slot is not None:
                raise InputError("a draft proposer serves one engine; make one per engine")
            self.slot = self.backend.allocate(batch, capacity)
        return self.slot

    def propose(self, engine: EngineView, wants: Mapping[int, int]) -> dict[int, Draft]:
        slot = self._slot(engine)
        ats = sorted(wants)
        contexts = {at: context(engine, at) for at in ats}
        news = {at: contexts[at][self.valid.get(at, 0):] for at in ats}
        batch = slot.cache.batch
        past = slot.cache.past_lens
        logits = self._catch_up(slot, news)
        for at in ats:
            past[at] += len(news[at])
        most = max(wants.values())
        tokens = np.zeros((batch, most), dtype=np.int64)
        probs: dict[int, list[np.ndarray]] = {at: [] for at in ats if not self._greedy(engine, at)}
        for j in range(most):
            tokens[:, j] = self._pick(engine, logits, ats, probs)
            if j + 1 == most:
                break
            running = np.zeros(batch, dtype=bool)
            running[[at for at in ats if wants[at] > j + 1]] = True
            logits = self.backend.decode(slot, tokens[:, j].copy(), running)
            past[running] += 1
        out = {}
        for at in ats:
            k = wants[at]
            self.fed[at] = tokens[at, : k - 1].copy()
            out[at] = Draft(tokens[at, :k].copy(), np.stack(probs[at][:k]) if at in probs else None)
        return out

    def _catch_up(self, slot: Any, news: dict[int, np.ndarray]) -> np.ndarray:
        """Feed each drafting row the context it has not seen, at its `valid`: one prefill call for all, or (a
        target whose attention extends one row per call after a past: `ort`) one per row on its row view.
        Each row's last-position logits [B, V]."""
        batch, capacity = slot.cache.batch, slot.cache.capacity
        past = slot.cache.past_lens
        for at in news:
            past[at] = self.valid.get(at, 0)
        limit = self.backend.limits.continue_batch
        if limit is not None and batch > limit and hasattr(self.backend, "row_view"):
            logits = None
            for at, new in news.items():
                if at not in self.views:
                    self.views[at] = self.backend.row_view(slot, at)
                row = self.backend.prefill(self.views[at], new[None], np.array([len(new) - 1], np.int64))[0]
                if logits is None:
                    logits = np.zeros((batch, row.shape[-1]), dtype=np.float32)
                logits[at] = row
            return logits
        width = max(len(n) for n in news.values())
        block = np.full((batch, width), self.export.pad_token_id, dtype=np.int64)
        last = np.zeros((batch, 1), dtype=np.int64)
        for at, new in news.items():
            block[at, : len(new)] = new
            last[at, 0] = len(new) - 1
        # Rows not drafting take part at their frozen past_lens: what is written there is never read, but it
        # must fit: a row near the end writes lower, and no longer counts what that overwrites as valid.
        for at in np.flatnonzero(past + width > capacity).tolist():
            if at not in news:
                past[at] = capacity - width
                if at in self.valid:
                    self.valid[at] = min(self.valid[at], capacity - width)
        return self.backend.prefill(slot, block, last)[:, 0]

    def _greedy(self, engine: EngineView, at: int) -> bool:
        return engine.pickers[at].sampler.config.greedy

    def _pick(self, engine: EngineView, logits: np.ndarray, ats: list[int],
              probs: dict[int, list[np.ndarray]]) -> np.ndarray:
        """Each drafting row's next token: the argmax, or a draw from the draft's distribution under the row's
        sampling settings (kept in `probs` for the rejection rule)."""
        picked = greedy_tokens(logits)
        for at in probs:
            config = engine.pickers[at].sampler.config
            p = target_distribution(logits[at], config)
            rng = self.rngs.get(at)
            if rng is None:
                # Seeded rows draft reproducibly: their own stream, apart from the acceptance draws: a child of
                # the row's acceptance stream (spawning draws nothing from it), so that the rows of one request
                # (which share that stream unless they are n > 1 choices) draft independently of each other.
                rng = self.rngs[at] = engine.rng_of(at).spawn(1)[0]
            picked[at] = draw(p, rng)
            probs[at].append(p)
        return picked

    def observe(self, engine: EngineView, kept: Mapping[int, tuple[int, int]], hidden: np.ndarray | None) -> None:
        for at, (first, count) in kept.items():
            fed = self.fed.pop(at, None)
            if fed is None:
                continue  # a prefill or a decode step: the next proposal catches up from `valid`
            # The cache holds the context up to `first` (the row's last token included) and the drafted
            # tokens after it; those the target kept (count - 1 of them at most) stay valid.
            ctx = context(engine, at)
            base = first + 1
            n = 0
            while n < len(fed) and n < count - 1 and base + n < len(ctx) and ctx[base + n] == fed[n]:
                n += 1
            self.valid[at] = base + n

    def release(self, at: int) -> None:
        if self.slot is not None:  # a stale length would count against the next calls' capacity check
            self.slot.cache.past_lens[at] = 0
        self.valid.pop(at, None)
        self.fed.pop(at, None)
        self.rngs.pop(at, None)

    def move(self, src: int, dst: int) -> None:
        if self.slot is not None and src in self.valid:
            self.backend.copy_rows(self.slot, src, self.slot, dst, self.valid[src])
        for table in (self.valid, self.fed, self.rngs):
            if src in table:
                table[dst] = table.pop(src)
        if self.slot is not None:
            self.slot.cache.past_lens[src] = 0
