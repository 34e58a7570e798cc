"""What a command reports of a speculative run (generate's and chat's --json, the stats line), from a
GenerationResult or a Scheduler's counters. The checks against a loaded target (check_target, open_draft) are the
runtime's (runtime/drivers/speculation_checks.py), named here for the command line."""

from __future__ import annotations

from typing import Any

from kvforge.runtime.drivers.speculation_checks import (  # noqa: F401 (the CLI's checks)
    check_target,
    open_draft,
    target_options,
)


def report(method: str, draft_len: int, draft_tokens: int, accepted_tokens: int, drafted_at: list[int],
           accepted_at: list[int], verify_steps: int, tokens_per_step: float) -> dict[str, Any]:
    """The `speculation` object of a command's --json: the method, the drafts and what the target kept of them
    (in all and per draft position: the share of drafts reaching position j that were kept through it), and the
    tokens taken per target graph run after the prefill). Positions no draft reached are left out."""
    reached = max((j + 1 for j, d in enumerate(drafted_at) if d), default=0)
    drafted_at, accepted_at = drafted_at[:reached], accepted_at[:reached]
    return {
        "method": method, "draft_len": draft_len, "draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens,
        "acceptance_rate": round(accepted_tokens / draft_tokens, 4) if draft_tokens else 0.0,
        "drafted_at": list(drafted_at), "accepted_at": list(accepted_at),
        "acceptance_by_position": [round(a / d, 4) if d else 0.0 for d, a in zip(drafted_at, accepted_at, strict=True)],
        "verify_steps": verify_steps, "tokens_per_step": round(tokens_per_step, 4),
    }


def summary(spec: dict[str, Any]) -> str:
    """The stats line's words for a `report()`."""
    return (f"{spec['accepted_tokens']}/{spec['draft_tokens']} drafted tokens accepted ({spec['method']}), "
            f"{spec['tokens_per_step']:.2f} tokens per step")


COUNTS = ("draft_tokens", "accepted_tokens", "verify_steps", "speculative_steps", "speculative_tokens", "drafted_at",
          "accepted_at")  # the Scheduler's speculation counters (runtime/drivers/scheduler_speculation.py)


def scheduler_counts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The speculation counters of a Scheduler.snapshot() (absent ones 0 / empty)."""
    return {key: list(snapshot.get(key) or ()) if key.endswith("_at") else snapshot.get(key, 0) for key in COUNTS}


def report_between(method: str, draft_len: int, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """report() of what a Scheduler did between two scheduler_counts() (one chat turn: its only request)."""
    def at(key: str) -> list[int]:
        old, new = before[key], after[key]
        return [n - (old[j] if j < len(old) else 0) for j, n in enumerate(new)]

    diff = {key: after[key] - before[key] for key in COUNTS if not key.endswith("_at")}
    steps = diff["speculative_steps"]
    return report(method, draft_len, diff["draft_tokens"], diff["accepted_tokens"], at("drafted_at"),
                  at("accepted_at"), diff["verify_steps"], diff["speculative_tokens"] / steps if steps else 0.0)
