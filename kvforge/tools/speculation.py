"""Speculative decoding's checks against a loaded target and what a command reports of a speculative run: shared by
the command line (kvforge/cli/speculation.py: generate, chat) and the server (kvforge/serve: serve's flags, its
request log and /metrics).

Checks, each one InputError of one line: whether the target can speculate at all (a recurrent-state cache cannot
drop rejected drafts), whether `eagle` / `mtp` find their head in the export (the manifest's "draft" record,
kvforge/core/draft_manifest.py) on a backend that runs heads, and whether a --draft folder is an export the
target's backend runs (its vocabulary is the runtime's check, runtime/drivers/draft_checks.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError, KvforgeError

if TYPE_CHECKING:
    from kvforge.runtime import LoadedExport

_HEADS = {"eagle": ("eagle3", "EAGLE-3 head"), "mtp": ("mtp", "MTP layer")}  # method -> (manifest kind, its name)
_HOW = {"eagle": "export with --eagle HEAD_DIR (an EAGLE-3 head trained for this model)",
        "mtp": "export a checkpoint that ships one (DeepSeek-V3, GLM-4.5, Qwen3-Next) with --mtp, the default"}


def check_target(export: LoadedExport, method: str | None, where: str | None = None) -> None:
    """InputError when the loaded target cannot speculate with `method`: a cache that cannot roll back, or a head
    method whose head the export does not carry or whose backend runs no head. `where`: what the message names
    (default: the flag, `--speculate METHOD`)."""
    if method is None:
        return
    where = where or f"--speculate {method}"
    export.backend.limits.check_speculation(method)
    if method not in _HEADS:
        return
    kind, name = _HEADS[method]
    record = export.manifest.get("draft")
    have = record.get("kind") if isinstance(record, dict) else None
    if have != kind:
        other = next((m for m, (k, _) in _HEADS.items() if k == have), None)
        if other is not None:
            raise InputError(f"{where}: this export carries no {name} but an {_HEADS[other][1]}; speculate with "
                             f"method {other}")
        raise InputError(f"{where}: this export carries no {name}; {_HOW[method]}")
    from kvforge.runtime.backends.target_hidden import HEAD_BACKENDS, heads_refused

    if export.backend_name not in HEAD_BACKENDS:  # a bad choice of backend for this request: bad input, not a 503
        raise InputError(f"{where}: {heads_refused(export.backend_name)}")


def open_draft(folder: Path, target: LoadedExport, **backend_options: Any) -> LoadedExport:
    """The draft export at `folder` on the target's backend; a folder that is not an export, or one the target's
    backend cannot run (another target type, a broken export), is one InputError naming --draft."""
    from kvforge.core.manifest import MANIFEST_NAME
    from kvforge.runtime import LoadedExport

    if not (folder / MANIFEST_NAME).is_file():
        raise InputError(f"--draft {folder}: not a kvforge export folder (no {MANIFEST_NAME}); export the draft "
                         "model with `kvforge export` first")
    try:
        return LoadedExport(folder, target.backend_name, **backend_options)
    except KvforgeError as err:
        message = f"--draft {folder}: {' '.join(str(err).split())}"
        theirs, ours = _target_of(folder), target.manifest.get("target")
        if theirs != ours:  # the usual cause: the draft runs on the target's backend, so it needs its target type
            message += f" (a draft runs on the target's backend: export it with --target {ours}, as the target was)"
        raise InputError(message) from err


def _target_of(folder: Path) -> Any:
    """The export target (ort, onnx, trt) an export folder's manifest names, None when it cannot be read."""
    import json

    from kvforge.core.manifest import MANIFEST_NAME

    try:
        return json.loads((folder / MANIFEST_NAME).read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None


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
