"""`kvforge serve` against the third hostile probe (issue 34): each test failed on the server before
its fix. Loopback only; a tiny random-weight export."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest
from serving import serving, with_template

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvforge.core.errors import CapacityError  # noqa: E402
from kvforge.serve.app import create_app  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SPIN = ("{% if messages[0]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% else %}" + TEMPLATE + "{% endif %}")
PHRASE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def chat_export(exported, tmp_path_factory) -> Path:
    return with_template(exported("llama-tiny", "ort"), tmp_path_factory.mktemp("reliability") / "chat", TEMPLATE)


@pytest.fixture(scope="module")
def server(chat_export):
    app = create_app(chat_export, max_batch=2, max_seq_len=64, model_name="tiny", prefill_chunk=16)
    with serving(app, log_level="critical") as base:
        yield app, base


# -- 3: large prompts are refused on a prefix, prepared on a bounded pool ------------------------------
def test_a_far_too_long_prompt_is_refused_after_tokenizing_a_prefix(server, monkeypatch) -> None:
    app, base = server
    service = app.state.service
    # Just under the character bound, which alone lets it through (the probe: 620K characters, 4096 tokens)
    long = (PHRASE * (service.max_prompt_chars // len(PHRASE) + 1))[: service.max_prompt_chars - 1]
    tokenizer = service.tokenizer
    seen: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    with pytest.raises(CapacityError, match=r"the prompt \(more than \d+ tokens\) does not fit"):
        service.encode(long, True)
    assert seen and max(seen) <= service.capacity * 8 < len(long)  # a prefix, never the whole text
    response = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]},
                          timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "context_length_exceeded"
    assert max(seen) <= service.capacity * 8  # refused before the template rendered it


def test_requests_are_prepared_on_a_bounded_pool_off_the_event_loop(server, monkeypatch) -> None:
    app, base = server
    service = app.state.service
    inside, most, names = [0], [0], set()
    lock = threading.Lock()
    encode = service.encode
    release = threading.Event()

    def spy(text, special, what="the prompt"):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            names.add(threading.current_thread().name.rsplit("_", 1)[0])
        release.wait(5)  # hold every caller: as many run at once as the pool lets in
        with lock:
            inside[0] -= 1
        return encode(text, special, what)

    monkeypatch.setattr(service, "encode", spy)
    post = lambda i: httpx.post(f"{base}/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 2},  # noqa: E731
                                timeout=30)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, i) for i in range(6)]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # answered while they wait
        release.set()
        assert all(f.result().status_code == 200 for f in futures)
    assert names == {"kvforge-prepare-text"} and most[0] == 2


# -- 4: requests that need no template never wait behind one that loops -----------------------------
def test_a_looping_template_does_not_stall_token_id_completions(exported, tmp_path) -> None:
    folder = with_template(exported("llama-tiny", "ort"), tmp_path / "spin", SPIN)
    app = create_app(folder, max_batch=2, max_seq_len=64, template_seconds=0.5)
    finished: list[str] = []
    with serving(app, log_level="critical") as base:
        def chat(_):
            httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "spin"}]},
                       timeout=60)
            finished.append("chat")

        with ThreadPoolExecutor(8) as pool:
            chats = [pool.submit(chat, i) for i in range(8)]  # 8 renders of 0.5 s each, one at a time
            next(as_completed(chats))  # every chat has arrived and waits for the renderer
            response = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
            finished.append("completion")
            for future in chats:
                future.result()
    assert response.status_code == 200, response.text
    assert finished[:2] == ["chat", "completion"], finished  # it did not queue behind the waiting chats
