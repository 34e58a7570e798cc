"""What `kvforge serve` tells its operator: one log line per request and /metrics in Prometheus text.

Log line: logger "kvforge.serve.app", INFO, message `request key=value ...` (logfmt; strings with spaces
or quotes are JSON-quoted); the same fields are on the record as `kvforge_fields`, which
`JsonFormatter` writes as one JSON object. Fields: id, endpoint, status, stream, finish_reason,
prompt_tokens, cached_tokens, completion_tokens, ttft_ms, decode_tokens_per_s, total_ms, and with speculation
speculate (the method) and draft_tokens, accepted_tokens, acceptance, verify_steps (where the scheduler reports
them per request); a refused request has id, endpoint, status, reason and total_ms only. A field that does not
apply is left out.

Times are taken in the server: from the handler's start (the body already read) to the first token's
event (TTFT), between consecutive token events (inter-token latency, observed in the scheduler
thread's event callback) and to the end of the response (total). Metrics live in a per-app
CollectorRegistry, so several apps in one process (tests) do not clash.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvforge.core.errors import InputError
from kvforge.serve.speculation import log_fields
from kvforge.serve.speculation import metric_families as speculation_metrics

LOGGER = logging.getLogger("kvforge.serve")
LOG_FORMATS = ("text", "json", "off")

# Buckets for CPU serving of small models: a first token in 10 ms (cached prompt) to a minute (a
# long prompt behind a queue), a token every ms (tiny model) to a second (big batch, big model).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


def logfmt(fields: dict[str, Any]) -> str:
    """key=value pairs; None values left out, strings that need it JSON-quoted."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, float):
            value = f"{value:.1f}"
        elif isinstance(value, str) and (not value or any(c in value for c in ' ="\\') or not value.isprintable()):
            value = json.dumps(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger and a request line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name}
        fields = getattr(record, "kvforge_fields", None)
        if fields is not None:
            out["event"] = "request"
            out.update({k: v for k, v in fields.items() if v is not None})
        else:
            out["message"] = record.getMessage()
        return json.dumps(out)


def request_log_handler(log_format: str) -> logging.Handler | None:
    """The stderr handler `kvforge serve` puts on "kvforge.serve.app" (None for "off")."""
    if log_format not in LOG_FORMATS:
        raise InputError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    if log_format == "off":
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(message)s"))
    return handler


class _SchedulerCollector:
    """Gauges and counters read from Scheduler.snapshot() at scrape time."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        s = self.scheduler.snapshot()
        for name, doc, value in (
                ("kvforge_queue_length", "requests waiting or being prefilled", s["waiting"]),
                ("kvforge_running_requests", "rows of the running batch in use", s["running"]),
                ("kvforge_prefix_cache_bytes", "bytes of KV rows kept for multi-turn reuse", s["prefix_bytes"]),
                ("kvforge_prefix_cache_entries", "token sequences kept for multi-turn reuse", s["prefix_entries"])):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("kvforge_prefill_tokens", "prompt positions run through the graph (not reused)", s["prefilled_tokens"]),
                ("kvforge_decode_steps", "decode steps of the running batch", s["decode_steps"]),
                ("kvforge_decode_tokens", "tokens produced by decode steps (all rows)", s["decode_tokens"]),
                ("kvforge_decode_seconds", "seconds spent in decode steps", s["decode_seconds"])):
            yield CounterMetricFamily(name, doc, value=value)
        yield from speculation_metrics(s)  # kvforge_speculative_*: kvforge/serve/speculation.py


class ServerMetrics:
    """The app's Prometheus registry and the per-request bookkeeping that feeds it and the log."""

    def __init__(self, scheduler: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvforge_time_to_first_token_seconds", "request arrival to its first token",
                              registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("kvforge_inter_token_latency_seconds", "time between consecutive tokens of a request",
                             registry=r, buckets=ITL_BUCKETS)
        self.duration = Histogram("kvforge_request_duration_seconds",
                                  "request arrival to the end of its response (requests that ran)",
                                  registry=r, buckets=REQUEST_BUCKETS)
        self.requests = Counter("kvforge_requests", "requests by endpoint, HTTP status and finish reason "
                                "(refused ones: finish_reason=\"refused\")",
                                ["endpoint", "status", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvforge_prompt_tokens", "prompt tokens of requests that ran", registry=r)
        self.completion_tokens = Counter("kvforge_completion_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("kvforge_cached_prompt_tokens", "prompt tokens reused from earlier turns",
                                     registry=r)
        r.register(_SchedulerCollector(scheduler))

    def exposition(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def trace(self, endpoint: str, request_id: str) -> RequestTrace:
        return RequestTrace(self, endpoint, request_id)

    def refused(self, endpoint: str, status: int, reason: str, request_id: str | None = None) -> None:
        """A request refused before it could run (the guard's 401/413/415/421 come here)."""
        RequestTrace(self, endpoint, request_id).refuse(status, reason)


class RequestTrace:
    """One request's times, logged and counted exactly once: `end(status)` when the handler is done
    with a request that ran (logged then, or when the scheduler's Done arrives if the client went
    away first), `refuse(status, reason)` for one that did not."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, request_id: str | None) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.id = request_id
        self.stream: bool | None = None
        self.arrived = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self._streams: dict[Any, float] = {}  # each choice's last token time
        self.done: Any = None  # the scheduler's Done
        self._lock = threading.Lock()  # taken once at the end, never per token
        self._ended_status: int | None = None
        self._logged = False
        self.tool_calls = False
        self.speculate: str | None = None  # the method its generations speculate with (None: none)

    def on_event(self, event: Any, stream: Any = 0) -> None:
        """Called in the scheduler thread for every Delta and the (request's one) Done, before the
        handler sees it. `stream`: which choice a Delta belongs to (a request with several prompts
        or n choices): the inter-token latency is measured within each."""
        now = time.perf_counter()
        if not hasattr(event, "finish_reason"):  # a Delta
            if self.first is None:
                self.first = now
            previous = self._streams.get(stream)
            if previous is not None:
                self.metrics.itl.observe(now - previous)
            self._streams[stream] = self.last = now
            return
        with self._lock:
            self.done = event
            status = self._ended_status
        if status is not None:
            self._finish(status)

    def end(self, status: int, tool_calls: bool = False) -> None:
        """The handler is done with the request: log it now if its Done came, else when it comes
        (the client went away and the request is being cancelled). `tool_calls`: the answer is a tool
        call, which the Done cannot tell (the log's finish_reason is then OpenAI's "tool_calls")."""
        self.tool_calls = tool_calls
        with self._lock:
            if self.done is None:
                self._ended_status = status
                return
        self._finish(status)

    def _claim(self) -> bool:
        with self._lock:
            if self._logged:
                return False
            self._logged = True
            return True

    def _finish(self, status: int) -> None:
        """The request ran and its Done arrived: log it and count it."""
        if not self._claim():
            return
        done, m = self.done, self.metrics
        end = time.perf_counter()
        reason = done.finish_reason.value
        if reason in ("eos", "stop"):
            reason = "tool_calls" if self.tool_calls else "stop"  # OpenAI's names (the log and the counter use them)
        ttft = self.first - self.arrived if self.first is not None else None
        tps = ((done.completion_tokens - 1) / (self.last - self.first)
               if done.completion_tokens > 1 and self.last is not None and self.last > self.first else None)
        if ttft is not None:
            m.ttft.observe(ttft)
        m.duration.observe(end - self.arrived)
        m.requests.labels(self.endpoint, str(status), reason).inc()
        m.prompt_tokens.inc(done.prompt_tokens)
        m.completion_tokens.inc(done.completion_tokens)
        m.cached_tokens.inc(done.cached_tokens)
        self._log({"id": self.id, "endpoint": self.endpoint, "status": status, "stream": self.stream,
                   "finish_reason": reason, "prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens,
                   "completion_tokens": done.completion_tokens,
                   "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
                   "decode_tokens_per_s": None if tps is None else round(tps, 1),
                   "total_ms": round((end - self.arrived) * 1e3, 1), "speculate": self.speculate,
                   **log_fields(done), "error": done.error})

    def refuse(self, status: int, reason: str) -> None:
        """The request was refused (or failed) before it ran: status and reason, no token counts."""
        if not self._claim():
            return
        self.metrics.requests.labels(self.endpoint, str(status), "refused").inc()
        self._log({"id": self.id, "endpoint": self.endpoint, "status": status, "stream": self.stream,
                   "reason": reason[:300], "total_ms": round((time.perf_counter() - self.arrived) * 1e3, 1)})

    @staticmethod
    def _log(fields: dict[str, Any]) -> None:
        if LOGGER.isEnabledFor(logging.INFO):
            LOGGER.info("request %s", logfmt(fields), extra={"kvforge_fields": fields})
