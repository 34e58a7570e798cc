"""`kvforge serve` against hostile clients, templates and files (issue 18, items 1-9 and 12): each test
here failed on the server before the fix. Loopback only; a tiny random-weight export."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving import serving, with_template

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.serve.app import allowed_hosts_for, check_api_key, create_app  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# One template for every way a template can go wrong, picked by the first message.
HOSTILE = (
    "{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}"
    "{% set what = messages[0]['content'] %}"
    "{% if what == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif what == 'write' %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    "{% elif what == 'divide' %}{{ 1/0 }}"
    "{% elif what == 'recurse' %}{{ down(0) }}"
    "{% else %}" + TEMPLATE + "{% endif %}"
)
CLI = [sys.executable, "-m", "kvforge.cli"]


class Served:
    """A served app, its base URL and port, with a POST that carries the API key by default."""

    def __init__(self, app, base: str) -> None:
        self.app = app
        self.base = base
        self.port = int(base.rsplit(":", 1)[1])

    def post(self, path: str, body: object, headers: dict | None = None, timeout: float = 30, **kw) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", headers=AUTH if headers is None else headers, json=body,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def chat_export(exported, tmp_path_factory) -> Path:
    return with_template(exported("llama-tiny", "ort"), tmp_path_factory.mktemp("hostile") / "chat", TEMPLATE)


@pytest.fixture(scope="module")
def hostile_export(exported, tmp_path_factory) -> Path:
    return with_template(exported("llama-tiny", "ort"), tmp_path_factory.mktemp("hostile") / "bad", HOSTILE)


@pytest.fixture(scope="module")
def server(chat_export):
    app = create_app(chat_export, max_batch=2, max_seq_len=64, api_key=KEY, model_name="tiny", prefill_chunk=16,
                     max_body_bytes=64 << 10, allowed_hosts=allowed_hosts_for("127.0.0.1"))
    with serving(app, log_level="critical") as base:
        yield Served(app, base)


@pytest.fixture(scope="module")
def hostile(hostile_export):
    app = create_app(hostile_export, max_batch=2, max_seq_len=64, template_seconds=0.5)
    with serving(app, log_level="critical") as base:
        yield Served(app, base)


@pytest.fixture(scope="module")
def reference(chat_export) -> Generator:
    return Generator(chat_export)


def _health_latency(base: str) -> float:
    start = time.monotonic()
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    return time.monotonic() - start


# -- 1. a non-streaming client that goes away cancels its generation --------------------------------
def test_non_streaming_client_that_disconnects_cancels_its_generation(server, reference) -> None:
    scheduler = server.app.state.scheduler
    prompt = next(p for p in ([5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32]) if
                  reference.generate([p], max_new_tokens=60, greedy=True).finish_reason[0] == "length")
    step = scheduler._decode_step

    def slow_step() -> None:  # 40 ms a token: 60 tokens take 2.4 s
        time.sleep(0.04)
        step()

    scheduler._decode_step = slow_step
    try:
        before = scheduler.snapshot()["completion_tokens"]
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", {"prompt": prompt, "max_tokens": 60, "temperature": 0}, timeout=0.3)
        gave_up = time.monotonic()
        while scheduler.snapshot()["running"] and time.monotonic() - gave_up < 3:
            time.sleep(0.02)
        freed_after = time.monotonic() - gave_up
        generated = scheduler.snapshot()["completion_tokens"] - before
    finally:
        del scheduler._decode_step
    assert freed_after < 0.8, f"the row stayed busy {freed_after:.2f} s after the client left"
    assert generated < 40, f"{generated} tokens generated for a client that had gone"


# -- 2. body size, tokenizing off the event loop, early refusal ----------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(server) -> None:
    big = {"prompt": "x" * (100 << 10), "max_tokens": 2}
    start = time.monotonic()
    response = server.post("/v1/completions", big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert "--max-body-bytes" in response.json()["error"]["message"]
    assert time.monotonic() - start < 5

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    chunked = httpx.post(f"{server.base}/v1/completions", content=chunks(), timeout=30,
                         headers={**AUTH, "Content-Type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_tokenized(server, monkeypatch) -> None:
    tokenizer = server.app.state.export.tokenizer
    calls = []
    original = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(len(text)) or original(text, *a, **k))
    response = server.post("/v1/completions", {"prompt": "word " * 10000, "max_tokens": 2})
    assert response.status_code == 413 and response.json()["error"]["code"] == "context_length_exceeded"
    assert calls == [], "the prompt was tokenized although it could not fit"


def test_tokenizing_does_not_block_the_event_loop(server, monkeypatch) -> None:
    tokenizer = server.app.state.export.tokenizer
    original = tokenizer.encode

    def slow(text, *args, **kwargs):
        time.sleep(1.5)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow)
    worker = threading.Thread(target=server.post, args=("/v1/completions", {"prompt": "hello", "max_tokens": 2}))
    worker.start()
    time.sleep(0.3)
    latency = _health_latency(server.base)
    worker.join()
    assert latency < 0.7, f"/health took {latency:.2f} s while a prompt was being tokenized"


# -- 3. a template that loops is stopped; the server keeps serving -------------------------------------
def test_a_looping_template_is_stopped_and_the_server_keeps_serving(hostile) -> None:
    results: dict[str, httpx.Response] = {}

    def chat(what: str) -> None:
        results[what] = hostile.post("/v1/chat/completions", {"messages": [{"role": "user", "content": what}],
                                                              "max_tokens": 2}, headers={}, timeout=20)

    spinning = threading.Thread(target=chat, args=("spin",))
    spinning.start()
    time.sleep(0.1)
    assert _health_latency(hostile.base) < 0.5
    ok = hostile.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, headers={})
    assert ok.status_code == 200
    spinning.join(timeout=20)
    chat("write")
    for what in ("spin", "write"):
        response = results[what]
        assert response.status_code == 400, (what, response.text)
        message = response.json()["error"]["message"]
        assert "chat_template.jinja" in message and ("took more than" in message or "more than" in message), message
    chat("hello")  # a fresh renderer answers the next request
    assert results["hello"].status_code == 200, results["hello"].text


# -- 4. whatever fails, the answer is OpenAI-shaped JSON -----------------------------------------------
@pytest.mark.parametrize(("what", "path", "body", "words"), [
    ("100k-deep JSON", "/v1/completions", b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "caf\\udce9", "max_tokens": 2}', "surrogate"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "caf\\udce9"}], "max_tokens": 2}', "surrogate"),
    ("lone surrogate in a stop string", "/v1/completions", b'{"prompt": "x", "stop": "\\ud800"}', "surrogate"),
])
def test_crashing_inputs_are_400_json(server, what, path, body, words) -> None:
    response = httpx.post(f"{server.base}{path}", content=body, timeout=30,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, (what, response.text)
    assert words in response.json()["error"]["message"]


@pytest.mark.parametrize(("what", "words"), [("divide", "ZeroDivisionError"), ("recurse", "stack")])
def test_templates_that_raise_are_400_json_naming_the_template(hostile, what, words) -> None:
    response = hostile.post("/v1/chat/completions", {"messages": [{"role": "user", "content": what}]}, headers={})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "chat_template.jinja" in message and words in message


def test_a_bug_is_a_500_in_openai_shape_and_unknown_paths_are_json(server, monkeypatch) -> None:
    def boom(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(server.app.state.scheduler, "submit", boom)
    response = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert response.status_code == 500 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "server_error" and "boom" in response.json()["error"]["message"]
    missing = httpx.get(f"{server.base}/v1/nothing", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"]


# -- 5. the template is read once; a file swapped later is never rendered ------------------------------
def test_a_template_swapped_after_loading_is_not_rendered(server, reference, tmp_path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    want = len(reference.chat_ids(messages))
    folder = server.app.state.export.folder
    outside = tmp_path / "outside.jinja"
    outside.write_text("{% for i in range(50) %}leaked {% endfor %}")
    target = folder / "chat_template.jinja"
    kept = tmp_path / "kept.jinja"
    shutil.move(target, kept)
    target.symlink_to(outside)
    try:
        response = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    finally:
        target.unlink()
        shutil.move(kept, target)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == want


def test_a_template_linked_out_of_the_folder_is_refused(chat_export, tmp_path) -> None:
    from kvforge.core.errors import ManifestError
    from kvforge.runtime.text.chat import read_chat_template

    folder = tmp_path / "linked"
    shutil.copytree(chat_export, folder)
    (tmp_path / "elsewhere.jinja").write_text(TEMPLATE)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.jinja")
    manifest = json.loads((folder / "kvforge.json").read_text())
    del manifest["files"]["chat_template.jinja"]  # even unlisted, a link out is not followed
    with pytest.raises(ManifestError, match="outside"):
        read_chat_template(folder, manifest)


# -- 6. content type, Host, the API description behind the key -----------------------------------------
def test_posts_must_be_json_hosts_are_checked_and_openapi_needs_the_key(server) -> None:
    url = f"{server.base}/v1/completions"
    plain = httpx.post(url, content=b'{"prompt": [5], "max_tokens": 1}', timeout=10,
                       headers={**AUTH, "Content-Type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    none = httpx.post(url, content=b'{"prompt": [5], "max_tokens": 1}', timeout=10, headers=AUTH)
    assert none.status_code == 415
    rebound = httpx.get(f"{server.base}/v1/models", headers={**AUTH, "Host": "attacker.example"}, timeout=10)
    assert rebound.status_code == 421 and "--allow-host attacker.example" in rebound.json()["error"]["message"]
    assert httpx.get(f"http://localhost:{server.port}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/openapi.json", timeout=10).status_code == 401
    assert httpx.get(f"{server.base}/openapi.json", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    assert "myhost.lan" in allowed_hosts_for("127.0.0.1", ["MyHost.lan"])
    assert "attacker.example" not in allowed_hosts_for("0.0.0.0")


# -- 7. API keys that can never match are refused at startup --------------------------------------------
@pytest.mark.parametrize("key", ["", " key", "key ", "kéy", "k\ney"])
def test_api_keys_that_cannot_match_are_refused(key) -> None:
    with pytest.raises(InputError, match="api-key"):
        check_api_key(key)


def test_serve_refuses_an_empty_api_key_in_one_line(tmp_path) -> None:
    run = subprocess.run([*CLI, "serve", str(tmp_path), "--api-key", ""], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--api-key" in run.stderr, run.stderr


# -- 8. honest API ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "logit_bias", {"5": 100}),
    ("/v1/completions", "top_logprobs", 2),  # chat's; completions' is logprobs=N
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "no_such_thing", 1),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "logit_bias", {"5": 1}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
])
def test_parameters_that_would_be_ignored_are_400_naming_them(server, path, field, value) -> None:
    body = {"prompt": [5, 6], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    response = server.post(path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and field in response.json()["error"]["message"]


def test_neutral_values_of_unsupported_parameters_are_accepted(server) -> None:
    response = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "frequency_penalty": 0,
                                               "logprobs": None, "echo": False, "best_of": 1, "user": "u"})
    assert response.status_code == 200, response.text


def test_chat_defaults_to_the_rest_of_the_context_and_takes_text_parts(server, reference) -> None:
    for content in ("Tell me a story", "Once upon a time", "hello there", "a b c"):
        messages = [{"role": "user", "content": content}]
        prompt = reference.chat_ids(messages)
        want = reference.chat(messages, max_new_tokens=64 - len(prompt) + 1, greedy=True)
        if len(want.tokens[0]) > 16:
            break
    else:
        pytest.skip("the random model ends every answer within 16 tokens")
    got = server.post("/v1/chat/completions", {"messages": messages, "temperature": 0}).json()
    assert got["choices"][0]["message"]["content"] == want.text[0]
    assert got["usage"]["completion_tokens"] == len(want.tokens[0]) > 16
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    joined = reference.chat([{"role": "user", "content": "hello\nworld"}], max_new_tokens=4, greedy=True)
    got = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 4,
                                               "temperature": 0})
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == joined.text[0]
    # The Python API takes and refuses what the server does (issue 43, 10).
    assert reference.chat([{"role": "user", "content": parts}], max_new_tokens=4, greedy=True).text == joined.text
    with pytest.raises(InputError, match="messages\\[0\\] has the key 'zzz', which a user message does not take"):
        reference.chat([{"role": "user", "content": "hi", "zzz": 1}], max_new_tokens=4)
    image = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    # A text export refuses an image part as taking no images (issue 53), before its URL is looked at.
    assert image.status_code == 400 and "takes no images" in image.json()["error"]["message"]


# -- 9 and 12. `kvforge serve`: one line before announcing; exit codes on signals ------------------------
def test_serve_on_a_busy_port_or_a_bad_host_is_one_line_before_announcing(chat_export) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([*CLI, "serve", str(chat_export), "--port", str(port)], capture_output=True, text=True,
                             timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "cannot listen" in run.stderr and "serving" not in run.stderr
    bad = subprocess.run([*CLI, "serve", str(chat_export), "--host", "192.0.2.1"], capture_output=True,  # TEST-NET
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--host" in bad.stderr, bad.stderr


def _start_serve(export: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([*CLI, "serve", str(export), "--port", "0"], stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    for line in process.stderr:  # the announcement, after any library warnings
        if "serving" in line:
            return process, line.split(" on ")[1].split("/v1")[0]
    raise AssertionError(f"kvforge serve exited with {process.wait()} before serving")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_serve_stops_on_signals_with_its_exit_code_even_while_a_template_spins(hostile_export, sig, code) -> None:
    process, base = _start_serve(hostile_export)
    try:
        spinning = threading.Thread(target=lambda: httpx.post(
            f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "spin"}]}, timeout=30))
        spinning.start()
        time.sleep(0.3)
        process.send_signal(sig)
        assert process.wait(timeout=15) == code
        spinning.join(timeout=30)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
