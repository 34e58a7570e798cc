"""`kvforge serve`'s low findings of issue 53: repeated Authorization (and other single) headers are refused,
not resolved by whichever came last; an integer too long to convert is a 400 naming its field; /health answers
while a request is being queued (its images encoded, the scheduler's lock taken). Loopback only; a tiny
random-weight export."""

from __future__ import annotations

import threading
import time

import pytest
from serving import serving

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvforge.serve.app import create_app  # noqa: E402

KEY = "test-key"


@pytest.fixture(scope="module")
def served(exported):
    app = create_app(exported("llama-tiny", "ort"), max_batch=2, max_seq_len=64, api_key=KEY, model_name="tiny")
    with serving(app, log_level="critical") as base:
        yield app, base


def test_more_than_one_authorization_header_is_refused_whichever_is_right(served) -> None:
    _, base = served
    url, body = f"{base}/v1/completions", {"prompt": [5], "max_tokens": 1}
    good, bad = ("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")
    assert httpx.post(url, json=body, headers=[good], timeout=30).status_code == 200
    for headers in ([bad, good], [good, bad], [good, good]):
        answer = httpx.post(url, json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (headers, answer.text)
        error = answer.json()["error"]
        assert error["message"] == "the request has more than one Authorization header; send exactly one"
        assert error["code"] == "repeated_header"
    twice = httpx.post(url, json=body, headers=[good, ("Content-Type", "application/json"),
                                                ("Content-Type", "text/plain")], timeout=30)
    assert twice.status_code == 400 and "more than one Content-Type header" in twice.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), [
    ('{"prompt": [5], "max_tokens": 1%s}', "max_tokens"),
    ('{"prompt": [5, 1%s], "max_tokens": 1}', "prompt[1]"),
    ('{"prompt": [5], "max_tokens": 1, "logit_bias": {"5": -1%s}}', "logit_bias.5"),
])
def test_an_integer_too_long_is_a_400_naming_its_field(served, body, field) -> None:
    _, base = served
    digits = "0" * 5000  # over Python's 4300-digit conversion limit
    answer = httpx.post(f"{base}/v1/completions", content=(body % digits).encode(), timeout=30,
                        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"] == (f"'{field}' is an integer too long (5001 digits); no parameter takes a number "
                                "that large")
    assert error["param"] == field.split("[")[0].split(".")[0]
    assert "set_int_max_str_digits" not in answer.text


def test_health_answers_while_a_request_is_being_queued(served, monkeypatch) -> None:
    """Queueing a request encodes its images and takes the scheduler's lock: it ran on the event loop, so a
    slow one held /health as long. Here the queueing waits until /health has answered: on the loop, /health
    would wait for it, and time out."""
    app, base = served
    scheduler = app.state.scheduler
    submit, entered, release = scheduler.submit, threading.Event(), threading.Event()

    def slow_submit(*args, **kwargs):
        entered.set()
        release.wait(30)
        return submit(*args, **kwargs)

    monkeypatch.setattr(scheduler, "submit", slow_submit)
    answers: list[int] = []
    client = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{base}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=60,
        headers={"Authorization": f"Bearer {KEY}"}).status_code))
    client.start()
    assert entered.wait(10)
    try:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert not release.is_set()  # answered while the request was still being queued
    finally:
        release.set()
    client.join(60)
    assert answers == [200]


def test_health_answers_while_a_metrics_scrape_waits_for_the_scheduler(served) -> None:
    """/metrics reads the scheduler's gauges under its lock: on the event loop, a scrape that waited for the lock
    held /health as long. Here the lock is held until /health has answered: on the loop, /health would time out."""
    app, base = served
    scheduler = app.state.scheduler
    held, release, scraped = threading.Event(), threading.Event(), []

    def hold() -> None:
        with scheduler._cond:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    scraper = threading.Thread(target=lambda: scraped.append(httpx.get(f"{base}/metrics", timeout=60).status_code))
    scraper.start()
    time.sleep(0.3)  # the scrape is waiting for the lock
    try:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert not release.is_set() and holder.is_alive()  # answered while the scrape still waited for the lock
    finally:
        release.set()
    holder.join()
    scraper.join(60)
    assert scraped == [200]
