"""`kvforge serve`'s observability: /metrics parses as Prometheus text and its histograms and counters
agree with the responses' `usage`; the request log has one line per request (refused, streamed and
disconnected ones included) with the ids and token counts the clients got."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from serving import serving, with_template

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from click.testing import CliRunner  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvforge.runtime import Generator  # noqa: E402
from kvforge.serve.app import create_app  # noqa: E402
from kvforge.serve.metrics import JsonFormatter, logfmt  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def chat_export(exported, tmp_path_factory) -> Path:
    """The session's tiny llama export with a chat template listed in its manifest."""
    return with_template(exported("llama-tiny", "ort"), tmp_path_factory.mktemp("metrics") / "chat", TEMPLATE)


@pytest.fixture(scope="module")
def served(chat_export):
    app = create_app(chat_export, max_batch=2, max_seq_len=96, api_key=KEY, model_name="tiny", prefill_chunk=16)
    with serving(app, log_level="critical") as base:
        yield base, app


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics (parsed by prometheus_client's own parser) by (name, labels)."""
    response = httpx.get(f"{base}/metrics", timeout=10)  # no key needed: scrapers
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    """The change of one sample; for a counter with labels not given, the sum over them."""
    def total(m: dict) -> float:
        return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls)
    return total(after) - total(before)


def request_lines(caplog, ids: list[str], timeout: float = 5.0) -> dict[str, logging.LogRecord]:
    """The request-log records of `ids` (a stream's line is written when its response ends, which
    may be just after the client read the last chunk), exactly one each."""
    deadline = time.monotonic() + timeout
    while True:
        records = [r for r in caplog.records if r.name == "kvforge.serve"]
        found = {i: [r for r in records if r.kvforge_fields.get("id") == i] for i in ids}
        if all(found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for i, rs in found.items():
        assert len(rs) == 1, f"{len(rs)} log lines for request {i}"
    return {i: rs[0] for i, rs in found.items()}


def sse(base: str, body: dict) -> tuple[str, dict, str]:
    """A streamed request: (id, usage of the last chunk, finish_reason)."""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert response.headers["x-request-id"] == chunks[0]["id"]
    return chunks[0]["id"], chunks[-1]["usage"], chunks[-1]["choices"][0]["finish_reason"]


def test_metrics_and_log_lines_agree_with_the_responses(served, caplog) -> None:
    base, _ = served
    caplog.set_level(logging.INFO, logger="kvforge.serve")
    before = scrape(base)
    ran: dict[str, dict] = {}  # id -> usage, as the clients got them
    reasons: dict[str, str] = {}

    def post(path: str, body: dict) -> dict:
        response = httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        got = response.json()
        assert response.headers["x-request-id"] == got["id"]
        ran[got["id"]], reasons[got["id"]] = got["usage"], got["choices"][0]["finish_reason"]
        return got

    post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
    messages = [{"role": "user", "content": "Hello there"}]
    first = post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
    answer = first["choices"][0]["message"]["content"]
    # The next turn reuses the first one's KV rows: cached tokens are counted.
    second = post("/v1/chat/completions", {"messages": messages + [{"role": "assistant", "content": answer},
                                                                    {"role": "user", "content": "and again"}],
                                           "max_tokens": 5, "temperature": 0})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    rid, usage, reason = sse(base, {"prompt": "The quick brown fox", "max_tokens": 7, "temperature": 0,
                                    "stream": True, "stream_options": {"include_usage": True}})
    ran[rid], reasons[rid] = usage, reason
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "temperature": 5}, headers=AUTH, timeout=30)
    assert refused.status_code == 400
    refused_id = refused.headers["x-request-id"]
    assert refused_id.startswith("cmpl-")
    unauthorised = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert unauthorised.status_code == 401

    lines = request_lines(caplog, [*ran, refused_id])
    after = scrape(base)

    # Histograms: one TTFT and one duration per request that ran, one inter-token gap per token after
    # the first; refused requests are in neither.
    n = len(ran)
    assert delta(after, before, "kvforge_time_to_first_token_seconds_count") == n
    assert delta(after, before, "kvforge_request_duration_seconds_count") == n
    gaps = sum(u["completion_tokens"] - 1 for u in ran.values())
    assert delta(after, before, "kvforge_inter_token_latency_seconds_count") == gaps
    assert delta(after, before, "kvforge_time_to_first_token_seconds_bucket", le="+Inf") == n
    # Token counters: the sums of the usage the clients got.
    assert delta(after, before, "kvforge_prompt_tokens_total") == sum(u["prompt_tokens"] for u in ran.values())
    assert delta(after, before, "kvforge_completion_tokens_total") == sum(u["completion_tokens"] for u in ran.values())
    assert delta(after, before, "kvforge_cached_prompt_tokens_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in ran.values())
    # Requests by status and finish reason.
    assert delta(after, before, "kvforge_requests_total", status="200") == n
    for r in set(reasons.values()):
        assert delta(after, before, "kvforge_requests_total", status="200", finish_reason=r) == list(
            reasons.values()).count(r)
    assert delta(after, before, "kvforge_requests_total", endpoint="/v1/completions", status="400",
                 finish_reason="refused") == 1
    assert delta(after, before, "kvforge_requests_total", endpoint="/v1/chat/completions", status="401",
                 finish_reason="refused") == 1
    # Gauges read from the scheduler at scrape time: nothing waits or runs now.
    assert after[("kvforge_queue_length", frozenset())] == 0
    assert after[("kvforge_running_requests", frozenset())] == 0
    assert after[("kvforge_prefix_cache_bytes", frozenset())] > 0

    # The log: one line per request, with the id and usage its client got.
    for i, u in ran.items():
        record = lines[i]
        text = record.getMessage()
        for key, value in (("id", i), ("status", 200), ("finish_reason", reasons[i]),
                           ("prompt_tokens", u["prompt_tokens"]), ("completion_tokens", u["completion_tokens"]),
                           ("cached_tokens", u["prompt_tokens_details"]["cached_tokens"])):
            assert f" {key}={value} " in f" {text} ", (key, text)
        assert "ttft_ms=" in text and "total_ms=" in text
        assert ("decode_tokens_per_s=" in text) == (u["completion_tokens"] > 1)
        # --log-format json writes the same fields as one object.
        obj = json.loads(JsonFormatter().format(record))
        assert obj["id"] == i and obj["completion_tokens"] == u["completion_tokens"] and obj["event"] == "request"
    assert lines[rid].kvforge_fields["stream"] is True
    text = lines[refused_id].getMessage()
    assert "status=400" in text and "temperature" in text and "prompt_tokens" not in text
    guard = [r for r in caplog.records if r.name == "kvforge.serve" and r.kvforge_fields["status"] == 401]
    assert len(guard) == 1 and guard[0].kvforge_fields["endpoint"] == "/v1/chat/completions"


def test_a_stream_whose_client_goes_away_is_logged_as_cancelled(served, chat_export, caplog) -> None:
    base, app = served
    caplog.set_level(logging.INFO, logger="kvforge.serve")
    prompt = next(p for p in ([5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32])
                  if Generator(chat_export).generate([p], max_new_tokens=40, greedy=True).finish_reason[0] == "length")
    scheduler = app.state.scheduler
    step = scheduler._decode_step

    def slow_step() -> None:  # 40 ms a token: the client leaves long before 40 tokens
        time.sleep(0.04)
        step()

    before = scrape(base)
    scheduler._decode_step = slow_step
    try:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=30) as response:
            lines = response.iter_lines()
            rid = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
            next(lines)  # one more token, then go away
        fields = request_lines(caplog, [rid])[rid].kvforge_fields
    finally:
        del scheduler._decode_step
    assert fields["finish_reason"] == "cancelled" and fields["status"] == 200 and fields["stream"] is True
    assert 1 <= fields["completion_tokens"] < 40 and fields["prompt_tokens"] == len(prompt)
    after = scrape(base)
    assert delta(after, before, "kvforge_requests_total", finish_reason="cancelled") == 1
    assert delta(after, before, "kvforge_completion_tokens_total") == fields["completion_tokens"]


def test_logfmt_quotes_what_needs_it() -> None:
    line = logfmt({"id": "cmpl-1", "status": 400, "stream": False, "skipped": None, "total_ms": 1.26,
                   "reason": 'bad "x" = y'})
    assert line == 'id=cmpl-1 status=400 stream=false total_ms=1.3 reason="bad \\"x\\" = y"'
    assert json.loads(line.split("reason=", 1)[1]) == 'bad "x" = y'


def test_log_format_is_checked_and_not_taken_with_ray(chat_export) -> None:
    from kvforge.cli import main

    wrong = CliRunner().invoke(main, ["serve", str(chat_export), "--log-format", "xml"])
    assert wrong.exit_code == 2 and "'xml' is not one of 'text', 'json', 'off'" in wrong.output
    ray = CliRunner().invoke(main, ["serve", str(chat_export), "--ray", "--log-format", "json"])
    assert ray.exit_code == 2 and "--log-format applies to the one-process server, not to --ray" in ray.output
