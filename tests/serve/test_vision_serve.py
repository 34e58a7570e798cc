"""`kvforge serve` on a vision-language export: chat with image_url data URLs through the openai client equals
`generate` with the same image, concurrent requests with different images answer as each alone, a second turn
about the same image reuses the cached prefix, and hostile images are 400s that leave nothing running."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import data_url, header_only_png, serving, with_template  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _png(seed: int, height: int, width: int) -> bytes:
    from PIL import Image

    rng = np.random.RandomState(seed)
    buffer = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _message(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from kvforge.exporter.export import export_model
    from kvforge.tools.vlm_fixtures import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-serve")
    build_tiny_vlm("llava", root / "hf")
    export_model(root / "hf", root / "export")
    return with_template(root / "export", root / "served", TEMPLATE)


@pytest.fixture(scope="module")
def server(folder):
    from kvforge.serve.app import create_app

    app = create_app(folder, max_batch=4, max_seq_len=256, model_name="vlm", prefill_chunk=8)
    with serving(app) as base:
        yield base, app


def _client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _chat(base: str, message: dict, tokens: int = 12, history: list | None = None) -> str:
    reply = _client(base).chat.completions.create(model="vlm", messages=[*(history or []), message],
                                                  max_tokens=tokens, temperature=0)
    return reply.choices[0].message.content


def test_served_chat_with_an_image_equals_generate(folder, server) -> None:
    from kvforge.runtime import Generator

    base, _ = server
    image = _png(1, 80, 100)
    served = _chat(base, _message("What is in this picture?", data_url(image)))
    gen = Generator(folder)
    alone = gen.chat([{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                   {"type": "image", "image": image}]}],
                     max_new_tokens=12, greedy=True)
    assert served == alone.text[0]
    # The image part's place is where the client puts it: before the text is another prompt.
    before = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                          {"type": "text", "text": "What is in this picture?"}]}
    assert _chat(base, before) != served


def test_concurrent_requests_with_different_images_answer_as_each_alone(server) -> None:
    base, _ = server
    messages = [_message(f"Picture {i}: describe it.", data_url(_png(10 + i, 60 + 10 * i, 90))) for i in range(4)]
    alone = [_chat(base, m) for m in messages]
    together: list[str | None] = [None] * 4

    def ask(i: int) -> None:
        together[i] = _chat(base, messages[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
    assert len(set(alone)) > 1  # the images matter


def test_a_second_turn_about_the_same_image_reuses_the_cache(server) -> None:
    base, app = server
    service = app.state.service
    first = _message("Look:", data_url(_png(30, 70, 70)))
    answer = _chat(base, first)
    cached_before = service.scheduler.stats["cached_tokens"]
    _chat(base, {"role": "user", "content": "And the colours?"}, history=[first, {"role": "assistant", "content": answer}])
    reused = service.scheduler.stats["cached_tokens"] - cached_before
    assert reused >= 16  # at least the image's tokens came from the prefix store
    # Another image at the same place shares only the text before it.
    cached_before = service.scheduler.stats["cached_tokens"]
    other = _message("Look:", data_url(_png(31, 70, 70)))
    _chat(base, {"role": "user", "content": "And the colours?"},
          history=[other, {"role": "assistant", "content": answer}])
    assert service.scheduler.stats["cached_tokens"] - cached_before < 16


@pytest.mark.parametrize("url, message", [
    (data_url(_png(2, 40, 40)[:50]), "could not be decoded"),
    ("data:image/png;base64,%%%not-base64%%%", "does not decode"),
    ("https://example.com/cat.png", "inline images only"),
    (data_url(_png(3, 1, 1)), "under the smallest side"),
    (data_url(header_only_png(20_000, 20_000)), "over the limit of 40000000 pixels"),
])
def test_hostile_images_are_400s_and_leave_nothing_running(server, url, message) -> None:
    base, app = server
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(base, _message("what is this", url))
    assert message in str(caught.value)
    snapshot = app.state.service.scheduler.snapshot()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0


def test_too_many_images_are_a_400_and_typed_placeholders_are_text(server) -> None:
    base, _ = server
    url = data_url(_png(4, 30, 30))
    with pytest.raises(openai.BadRequestError, match="at most 8"):
        _chat(base, _message("many", *[url] * 9))
    # Only image parts make image places: "<image>" typed in the text stays text (a 400 before, issue 53).
    assert isinstance(_chat(base, _message("two places <image> <image>", url)), str)


def test_generate_image_and_chat_image_commands(folder, tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.runtime import Generator

    image = tmp_path / "picture.png"
    image.write_bytes(_png(40, 90, 60))
    gen = Generator(folder)
    want = gen.generate("Describe <image> briefly", images=[image], max_new_tokens=8, greedy=True, ignore_eos=True)
    out = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "Describe <image> briefly", "--image",
                                    str(image), "--max-new-tokens", "8", "--greedy", "--ignore-eos", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["tokens"] == want.tokens

    answer = gen.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                    {"type": "image", "image": image}]}],
                      max_new_tokens=8, greedy=True, ignore_eos=True)
    piped = f"/image {image}\nWhat is it?\nAnd now?\n"
    out = CliRunner().invoke(main, ["chat", str(folder), "--max-new-tokens", "8", "--greedy", "--ignore-eos",
                                    "--json", "--quiet"], input=piped)
    assert out.exit_code == 0, out.output
    turns = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert turns[0]["answer"] == answer.text[0]
    assert turns[1]["cached_tokens"] >= 16  # the second turn's prefix, the image's tokens included, was kept

    out = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "a", "--prompt", "b", "--image", str(image)])
    assert out.exit_code == 2 and "--image and --video go with one prompt" in out.output
    broken = tmp_path / "broken.png"
    broken.write_bytes(image.read_bytes()[:60])
    for bad, says in ((tmp_path / "missing.png", "is not a file"), (broken, "could not be decoded")):
        out = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "<image>", "--image", str(bad)])
        assert out.exit_code == 2 and says in out.output and len(out.output.strip().splitlines()) == 1, out.output
    out = CliRunner().invoke(main, ["chat", str(folder), "--quiet"], input=f"/image {tmp_path / 'missing.png'}\n")
    assert out.exit_code == 2 and "is not a file" in out.output


def test_special_token_text_in_a_chat_with_an_image_stays_text(folder) -> None:
    from kvforge.runtime import Generator

    gen = Generator(folder)
    eos = gen.tokenizer.encode("</s>", False)
    assert len(eos) == 1  # "</s>" typed is the end-of-sequence token when parsed
    ids, images = gen.chat_inputs([{"role": "user", "content": [
        {"type": "text", "text": "What </s> is this?"}, {"type": "image", "image": _png(7, 40, 40)}]}])
    assert len(images) == 1 and ids.count(gen.images.vision["image_token_id"]) == 1
    assert eos[0] not in ids  # the typed "</s>" is plain text, as in a chat without images
