"""Images in the runtime and the server, against hostile or unusual input (issue 53): a PIL image is known by all
that its preprocessing reads, a queued request holds features rather than pixels, usage counts image tokens, errors
name what was wrong (no reprs), text exports refuse images as such, image_url.detail is checked, a refused chat
message drops its images, a crafted manifest `vision` record is one line naming its field, and EXIF orientation is
applied as transformers applies it. One tiny LLaVA export (and its --text-only twin) serves every test."""

from __future__ import annotations

import base64
import gc
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from serving import with_template  # noqa: E402

from kvforge.core.errors import InputError, KvforgeError, ManifestError  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from kvforge.exporter.export import export_model
    from kvforge.tools.vlm_fixtures import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-hardening")
    build_tiny_vlm("llava", root / "hf")
    export_model(root / "hf", root / "export")
    export_model(root / "hf", root / "text", text_only=True)
    return {"hf": root / "hf", "vision": with_template(root / "export", root / "vision-chat", TEMPLATE),
            "text": with_template(root / "text", root / "text-chat", TEMPLATE), "root": root}


@pytest.fixture(scope="module")
def generator(folders):
    from kvforge.runtime import Generator

    return Generator(folders["vision"])


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _noise(seed: int, height: int, width: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)


def _prefill_logits(generator, image) -> np.ndarray:
    result = generator.generate("USER: <image>\nWhat is it? ASSISTANT:", images=[image], max_new_tokens=1,
                                greedy=True, keep_logits=True)
    return result.logits[0][0]


# -- item 3: a PIL image's identity ---------------------------------------------------------------------------------
def test_pil_images_differing_only_in_palette_or_size_get_their_own_features(folders, generator) -> None:
    from PIL import Image

    from kvforge.runtime import Generator

    indices = (np.arange(40 * 30) % 7).astype(np.uint8).reshape(30, 40)
    first = Image.fromarray(indices, "P")
    first.putpalette([v for i in range(256) for v in (i * 37 % 256, i * 91 % 256, i * 13 % 256)])
    other = Image.fromarray(indices, "P")
    other.putpalette([v for i in range(256) for v in (255 - i * 53 % 256, i * 17 % 256, 200 - i % 200)])
    data = _noise(1, 30, 40).tobytes()
    wide, tall = Image.frombytes("RGB", (40, 30), data), Image.frombytes("RGB", (30, 40), data)
    for a, b in ((first, other), (wide, tall)):
        assert a.tobytes() == b.tobytes()  # what the digest was made of before
        shared = [_prefill_logits(generator, a), _prefill_logits(generator, b)]
        fresh = Generator(generator.export.folder)  # nothing kept: b's own answer
        alone = _prefill_logits(fresh, b)
        assert np.abs(shared[0] - alone).max() > 1e-3  # the two images answer differently
        np.testing.assert_allclose(shared[1], alone, rtol=0, atol=1e-5)
        assert generator.export.images.encode([a])[0].digest != generator.export.images.encode([b])[0].digest


# -- item 4: what a queued request holds ----------------------------------------------------------------------------
def _held_bytes(root: object) -> int:
    """The bytes of every numpy array and decoded PIL image reachable from `root` (modules and classes not
    followed)."""
    from PIL import Image

    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or type(obj).__name__ == "module":
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            total += obj.nbytes
        elif isinstance(obj, Image.Image):
            total += obj.width * obj.height * len(obj.getbands())
            continue
        stack.extend(gc.get_referents(obj))
    return total


def test_a_queued_image_request_holds_features_not_decoded_pixels(folders, generator) -> None:
    from PIL import Image, ImageDraw

    from kvforge.runtime.drivers.scheduler import Scheduler
    from kvforge.runtime.service import GenerationService

    big = Image.new("RGB", (4000, 3000), (20, 90, 200))
    ImageDraw.Draw(big).ellipse((500, 500, 3000, 2500), fill=(250, 200, 10))
    data = _png(big)
    assert len(data) < 200_000  # small to send, 36 MB decoded
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    message = {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                           {"type": "image_url", "image_url": {"url": url}}]}
    service = GenerationService(generator, max_batch=1, max_seq_len=128)
    queue = Scheduler(generator.export, max_batch=1, max_seq_len=128, max_queue=8)  # never started: requests wait
    try:
        for _ in range(4):  # the server's path: read and encoded on the preparation thread, then submitted
            ids, images = service.conversation_with_images([message], None)
            queue.submit(service.request(ids, 4, images=images))
        held = _held_bytes([job.handle.request for job in queue._waiting])
    finally:
        service.close()
        queue.close()
    features = generator.export.images.vision["tokens_per_image"] * generator.export.images.vision["hidden_size"] * 4
    assert held <= 4 * features + 4096, f"4 queued requests hold {held} bytes"


def test_a_requests_images_are_decoded_one_at_a_time(generator, monkeypatch) -> None:
    import weakref

    from PIL import Image

    import kvforge.runtime.drivers.images as images_module

    decoded, alive = [], []
    load, features = images_module.load_image, images_module.Images._features

    def loading(source, limits):
        loaded = load(source, limits)
        decoded.append(weakref.ref(loaded.image))
        return loaded

    def encoding(self, loaded, *rest):
        gc.collect()
        alive.append(sum(ref() is not None for ref in decoded))
        return features(self, loaded, *rest)

    monkeypatch.setattr(images_module, "load_image", loading)
    monkeypatch.setattr(images_module.Images, "_features", encoding)
    sources = [_png(Image.fromarray(_noise(seed, 300, 400))) for seed in range(3)]
    encoded = generator.export.images.encode(sources)
    assert len(encoded) == 3 and alive == [1, 1, 1]  # each decoded image is gone before the next is decoded


# -- item 6: usage counts image tokens -------------------------------------------------------------------------------
def test_usage_counts_each_images_tokens_and_cached_tokens_never_exceed_them(folders, generator) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from PIL import Image
    from serving import serving

    from kvforge.serve.app import create_app

    image = Image.fromarray(_noise(3, 60, 50))
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    message = {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                           {"type": "image_url", "image_url": {"url": url}}]}
    solo = generator.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                       {"type": "image", "image": image}]}], max_new_tokens=3,
                          greedy=True)
    app = create_app(folders["vision"], max_batch=2, max_seq_len=256, model_name="vlm", prefill_chunk=8)
    with serving(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        first = client.chat.completions.create(model="vlm", messages=[message], max_tokens=3, temperature=0)
        again = client.chat.completions.create(model="vlm", messages=[message], max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens == solo.prompt_tokens[0]
    assert first.usage.prompt_tokens > generator.export.images.vision["tokens_per_image"]
    assert again.usage.prompt_tokens == solo.prompt_tokens[0]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens


# -- item 7: an undecodable image's message ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "png-signature", "gif-header", "truncated-png"])
def test_an_undecodable_image_is_named_without_reprs(kind: str) -> None:
    from PIL import Image

    from kvforge.runtime.media.images import load_image

    data = {"text": b"this is not an image at all", "png-signature": b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
            "gif-header": b"GIF89a" + b"\x01" * 30,
            "truncated-png": _png(Image.fromarray(_noise(7, 40, 40)))[:300]}[kind]
    with pytest.raises(InputError) as caught:
        load_image(data)
    message = str(caught.value)
    assert " at 0x" not in message and "<_io" not in message and "object" not in message
    assert "PNG, JPEG, WebP, GIF or BMP" in message


# -- Low: a text export refuses images as such ---------------------------------------------------------------------
def test_a_text_only_export_refuses_images_as_taking_none(folders) -> None:
    from PIL import Image

    from kvforge.runtime import Generator
    from kvforge.runtime.service import GenerationService

    url = "data:image/png;base64," + base64.b64encode(_png(Image.new("RGB", (8, 8)))).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    text = Generator(folders["text"])
    for call in (lambda: text.chat(messages, max_new_tokens=2),
                 lambda: text.chat([{"role": "user", "content": [{"type": "image", "image": url}]}], max_new_tokens=2),
                 lambda: text.generate("hi", images=[url], max_new_tokens=2)):
        with pytest.raises(InputError, match="takes no images: it was exported from a text model, or with --text-only"):
            call()
    service = GenerationService(text, max_batch=1, max_seq_len=64)
    try:
        with pytest.raises(InputError, match="takes no images"):
            service.conversation_with_images(messages, None)
    finally:
        service.close()


# -- Low: image_url.detail ------------------------------------------------------------------------------------------
def test_image_url_detail_takes_openais_values_and_names_another(folders, generator) -> None:
    from PIL import Image

    from kvforge.runtime.service import GenerationService

    url = "data:image/png;base64," + base64.b64encode(_png(Image.fromarray(_noise(4, 40, 40)))).decode()

    def messages(detail):
        image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
        return [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": image_url}]}]

    plain = generator.chat(messages(None), max_new_tokens=4, greedy=True).tokens
    for detail in ("auto", "low", "high"):
        assert generator.chat(messages(detail), max_new_tokens=4, greedy=True).tokens == plain
    for bad in ("ultra", 3):
        with pytest.raises(InputError, match=r"messages\[0\]\.content\[1\]\.image_url\.detail is .*'auto', 'low', "
                                             r"'high'"):
            generator.chat(messages(bad), max_new_tokens=4)
    service = GenerationService(generator, max_batch=1, max_seq_len=64)
    try:
        with pytest.raises(InputError, match=r"image_url\.detail is 'ultra'"):
            service.conversation_with_images(messages("ultra"), None)
    finally:
        service.close()


# -- Low: kvforge chat drops a refused message's images --------------------------------------------------------------
def test_kvforge_chat_drops_the_images_of_a_refused_message(folders, tmp_path) -> None:
    from PIL import Image

    from kvforge.cli.chat import ChatSession
    from kvforge.runtime.drivers.loaded_export import LoadedExport
    from kvforge.runtime.drivers.scheduler import Scheduler

    export = LoadedExport(folders["vision"])
    image = tmp_path / "a.png"
    image.write_bytes(_png(Image.fromarray(_noise(5, 30, 30))))
    question = "What is it?"
    alone = len(export.chat_inputs([{"role": "user", "content": question}])[0])
    # Room for the question and its answer, not for the image's tokens as well.
    scheduler = Scheduler(export, max_batch=1, max_seq_len=alone + 4, keep_cancelled=True).start()
    try:
        session = ChatSession(export, scheduler, None, 2, greedy=True)
        session.add_image(str(image))
        assert session.images[0].image is None  # the conversation keeps features, not pixels
        with pytest.raises(KvforgeError, match=r"no longer fits.*the 1 image\(s\) added with /image were dropped"):
            session.ask(question, lambda _: None)
        assert session.images == []
        turn = session.ask(question, lambda _: None)  # asked again: not refused for the dropped image
        assert turn.done.prompt_tokens == alone
    finally:
        scheduler.close()


# -- Low: a crafted manifest vision record ---------------------------------------------------------------------------
def _crafted(folders, name: str, change) -> Path:
    out = folders["root"] / f"crafted-{name}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folders["vision"], out)
    manifest = json.loads((out / "kvforge.json").read_text())
    change(manifest)
    (out / "kvforge.json").write_text(json.dumps(manifest))
    return out


def _set(path: str, value):
    def change(manifest):
        *parents, last = path.split(".")
        target = manifest
        for key in parents:
            target = target[key]
        target[last] = value
    return change


@pytest.mark.parametrize("name, change, field", [
    ("side", _set("vision.image_size", [16384, 16384]), "vision.image_size"),
    ("size", _set("vision.image_size", [64, 64]), "vision.channels and vision.image_size"),
    ("tokens", _set("vision.tokens_per_image", 17), "vision.tokens_per_image and vision.hidden_size"),
    ("hidden", _set("vision.hidden_size", 65), "vision.tokens_per_image and vision.hidden_size"),
    ("huge", lambda m: m["vision"].update(tokens_per_image=65536, hidden_size=4096),
     "vision.tokens_per_image x vision.hidden_size"),
    ("crop", _set("vision.processor.crop_size", "56"), "vision.processor.crop_size"),
    ("edge", _set("vision.processor.size", {"shortest_edge": 10 ** 6}), "vision.processor.size"),
    ("mean", _set("vision.processor.image_mean", "grey"), "vision.processor.image_mean"),
    ("std", _set("vision.processor.image_std", [0, 0, 0]), "vision.processor.image_std"),
    ("resample", _set("vision.processor.resample", 99), "vision.processor.resample"),
    ("flag", _set("vision.processor.do_center_crop", "yes"), "vision.processor.do_center_crop"),
    ("output", _set("vision.processor.crop_size", {"height": 48, "width": 48}), "vision.processor makes images"),
])
def test_a_crafted_vision_record_is_refused_at_load_naming_its_field(folders, name, change, field) -> None:
    from kvforge.runtime.drivers.loaded_export import LoadedExport

    with pytest.raises(ManifestError) as caught:
        LoadedExport(_crafted(folders, name, change))
    message = str(caught.value)
    assert field in message and "\n" not in message, message


def test_a_record_and_declared_shapes_unlike_the_vision_graph_are_refused_before_any_image(folders) -> None:
    from PIL import Image

    from kvforge.runtime.drivers.loaded_export import LoadedExport

    def change(manifest):
        manifest["vision"]["image_size"] = [64, 64]
        manifest["vision"]["processor"]["crop_size"] = {"height": 64, "width": 64}
        manifest["vision"]["processor"]["size"] = {"shortest_edge": 64}
        manifest["graphs"]["vision"]["inputs"][0]["shape"] = [1, 3, 64, 64]
    export = LoadedExport(_crafted(folders, "graph", change))  # the record agrees with the declared shapes
    with pytest.raises(ManifestError, match=r"vision\.channels and vision\.image_size say pixel_values \[1, 3, 64, 64\], "
                                            r"but vision\.onnx takes \[1, 3, 56, 56\]"):
        export.images.encode([Image.new("RGB", (8, 8))])


# -- Low: EXIF orientation, as transformers applies it ---------------------------------------------------------------
def test_exif_orientation_is_applied_as_transformers_applies_it(folders, tmp_path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    from kvforge.runtime.media.images import load_image
    from kvforge.runtime.media.preprocess import preprocess

    record = json.loads((folders["vision"] / "kvforge.json").read_text())["vision"]["processor"]
    hf = AutoImageProcessor.from_pretrained(folders["hf"])
    image = Image.fromarray(_noise(6, 40, 90))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown rotated 90 degrees clockwise
    path = tmp_path / "sideways.jpg"
    image.save(path, format="JPEG", exif=exif, quality=95)
    data = path.read_bytes()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    upright = hf(images=str(path), return_tensors="np")["pixel_values"][0]  # transformers loads a path upright
    assert not np.array_equal(upright, hf(images=Image.open(path), return_tensors="np")["pixel_values"][0])
    for source in (str(path), path, data, url):
        np.testing.assert_array_equal(preprocess(load_image(source).image, record), upright)
    # A PIL image handed in is taken as it is, as transformers' processors take it.
    opened = Image.open(path)
    np.testing.assert_array_equal(preprocess(load_image(opened).image, record),
                                  hf(images=opened, return_tensors="np")["pixel_values"][0])
