"""Speculative decoding in `kvforge serve`: the server's default (its --speculate, --draft, --draft-len,
--adaptive-draft flags, checked when the app is built), each request's choice, and the counters /metrics shows.

A request's kvforge extension (validated in kvforge/serve/protocol.py):

    "speculate": {"method": "prompt-lookup" | "draft" | "eagle" | "mtp", "draft_len": N}   # its own method
    "speculate": {"method": "off"}  or  "speculate": false                                  # none, whatever the default
    (absent or null)                                                                        # the server's default

A method without draft_len drafts up to the server's --draft-len. Sampling fields apply as without speculation:
greedy rows give greedy decoding's tokens, sampled rows the target's distribution (the rejection rule).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError
from kvforge.runtime.drivers.speculation_checks import check_target, open_draft
from kvforge.serve.guard import ApiError

if TYPE_CHECKING:
    from kvforge.runtime import LoadedExport
    from kvforge.serve.protocol import OpenAIRequest

OFF = "off"  # runtime/controls/speculate.py's OFF: a request that opts out of the server's default


def scheduler_options(export: LoadedExport, speculate: str | None, draft: str | Path | None, draft_len: int,
                      adaptive: bool, **backend_options: Any) -> dict[str, Any]:
    """The Scheduler's speculation keywords for the server's flags, checked against the loaded target first (one
    InputError: a target that cannot speculate, a head it lacks, a draft that is no export its backend runs)."""
    check_target(export, speculate)
    loaded = open_draft(Path(draft), export, **backend_options) if draft is not None else None
    return {"speculate": speculate, "draft_len": draft_len, "draft": loaded, "adaptive": adaptive}


def request_options(body: OpenAIRequest, export: LoadedExport, server_draft_len: int | None) -> dict[str, Any]:
    """`Generator.request` keywords for a body's "speculate" ({} without it: the server's default applies). A head
    method on an export without that head is a 400 here, in the words of the command line."""
    spec = body.speculate
    if spec is None:
        return {}
    if spec is False or spec.get("method") == OFF:
        return {"speculate": OFF}
    method = spec["method"]
    try:
        check_target(export, method, where=f"'speculate' method {method!r}")
    except InputError as err:
        raise ApiError(400, str(err), param="speculate") from err
    draft_len = spec.get("draft_len")
    if draft_len is None:
        draft_len = server_draft_len
    return {"speculate": method, **({"draft_len": draft_len} if draft_len is not None else {})}


# Prometheus counters of the Scheduler's speculation (Scheduler.snapshot(); runtime/drivers/scheduler_speculation.py)
COUNTERS = (
    ("kvforge_speculative_draft_tokens", "tokens drafted and verified (every method)", "draft_tokens"),
    ("kvforge_speculative_accepted_tokens", "drafted tokens the target kept", "accepted_tokens"),
    ("kvforge_speculative_verify_steps", "verification calls of the target (each checks one or more rows' drafts)",
     "verify_steps"),
    ("kvforge_speculative_row_steps", "target calls a speculating row took part in (one per row and call)",
     "speculative_steps"),
    ("kvforge_speculative_row_tokens", "tokens speculating rows took from those calls", "speculative_tokens"),
)


def metric_families(snapshot: dict[str, Any]) -> Iterator[Any]:
    """The speculation counters and gauges of one Scheduler.snapshot(): totals, the acceptance rate, tokens per
    target step of the speculating rows, and drafts / acceptances per draft position (label `position`, 1-based)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, key in COUNTERS:
        yield CounterMetricFamily(name, doc, value=snapshot.get(key, 0))
    drafted, accepted = snapshot.get("draft_tokens", 0), snapshot.get("accepted_tokens", 0)
    yield GaugeMetricFamily("kvforge_speculative_acceptance_rate", "accepted / drafted tokens since the start",
                            value=accepted / drafted if drafted else 0.0)
    steps = snapshot.get("speculative_steps", 0)
    yield GaugeMetricFamily("kvforge_speculative_tokens_per_step", "tokens a speculating row took per target call "
                            "since the start (1.0: no draft kept)",
                            value=snapshot.get("speculative_tokens", 0) / steps if steps else 0.0)
    by_position = [CounterMetricFamily("kvforge_speculative_position_drafted_tokens",
                                       "drafts that reached this draft position", labels=["position"]),
                   CounterMetricFamily("kvforge_speculative_position_accepted_tokens",
                                       "drafts kept through this draft position", labels=["position"])]
    drafted_at = list(snapshot.get("drafted_at") or ())
    reached = max((j + 1 for j, d in enumerate(drafted_at) if d), default=0)  # positions no draft reached: none
    for key, family in zip(("drafted_at", "accepted_at"), by_position, strict=True):
        for j, value in enumerate(list(snapshot.get(key) or ())[:reached]):
            family.add_metric([str(j + 1)], value)
    yield from by_position


def log_fields(done: Any) -> dict[str, Any]:
    """A request log line's speculation fields from its (merged) Done, where the scheduler reports them."""
    drafted = getattr(done, "draft_tokens", None)
    if not drafted:
        return {}
    accepted = getattr(done, "accepted_tokens", 0) or 0
    fields = {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance": round(accepted / drafted, 3)}
    steps = getattr(done, "verify_steps", None)
    if steps:
        fields["verify_steps"] = steps
    return fields


def method_of(requests: list[Any], scheduler: Any) -> str | None:
    """The speculation method a request's generations run with (their own, else the scheduler's default), None
    for none: the request log's `speculate` field."""
    for request in requests:
        if request is None:
            continue
        spec = request.speculation
        if spec is None:
            spec = getattr(getattr(scheduler, "speculation", None), "default", None)
        return spec.method if spec is not None and spec.method != OFF else None
    return None
