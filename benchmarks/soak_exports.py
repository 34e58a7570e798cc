"""The soak's image and pre-quantised exports (issue 53), beside benchmarks/soak_server.py's text one.

- vlm: the tiny seeded LLaVA of kvforge/tools/vlm_fixtures.py with a LLaVA-1.5-style chat template that reads
  content parts, asked about images sent as data URLs: noise, JPEG, grey and RGBA pictures, two palette images
  that differ only in their palette, the same pixel bytes at swapped sizes, two images in one message, an image in
  an earlier turn; and hostile ones (a truncated PNG, a bomb's header, undecodable bytes, bad base64, a remote
  URL, a 1x1 image, nine images), each a 4xx.
- gptq, awq: llama-tiny with the text soak's chat template, packed in that format by tests/prequantized_checkpoints.py
  and exported with its own integers (int4 MatMulNBits), asked the text soak's requests.
"""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import data_url, header_only_png  # noqa: E402  (the tests' image helpers)

# LLaVA-1.5's layout: a message's image parts first, then its text parts; a str content is its text.
VLM_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}{% if m['content'] is string %}{{ m['content'] + ' ' }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
JSON = {"Content-Type": "application/json"}


def build_vlm(root: Path) -> Path:
    """The tiny LLaVA with VLM_TEMPLATE, exported whole (vision.onnx) for ort-cpu."""
    from kvforge.exporter.export import export_model
    from kvforge.tools.vlm_fixtures import build_tiny_vlm

    build_tiny_vlm("llava", root / "vlm-hf")
    (root / "vlm-hf" / "chat_template.jinja").write_text(VLM_TEMPLATE)
    export_model(root / "vlm-hf", root / "vlm-export")
    return root / "vlm-export"


def build_prequantized(root: Path, fmt: str, chat_source: Path) -> Path:
    """`chat_source` (an fp32 llama-tiny folder with a chat template) packed as `fmt` ("gptq", "awq"), exported."""
    from prequantized_checkpoints import make

    from kvforge.exporter.export import export_model

    make(root / f"{fmt}-hf", chat_source, fmt)
    export_model(root / f"{fmt}-hf", root / f"{fmt}-export")
    return root / f"{fmt}-export"


# -- images ------------------------------------------------------------------------------------------
def _encoded(image: Any, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return buffer.getvalue()


def _noise(seed: int, height: int, width: int, mode: str = "RGB") -> Any:
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = (np.random.RandomState(seed).rand(height, width, channels) * 255).astype(np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def good_images() -> dict[str, bytes]:
    """Legal images, among them pairs that only a digest of mode, size and palette (or of the encoded bytes) tells
    apart: palette images with the same indices, and the same pixel bytes at swapped sizes."""
    from PIL import Image

    indices = (np.arange(48 * 64).reshape(48, 64) % 7).astype(np.uint8)
    palette = list(np.random.RandomState(5).randint(0, 256, 7 * 3))
    warm, cool = Image.fromarray(indices, "P"), Image.fromarray(indices, "P")
    warm.putpalette(palette)
    cool.putpalette(palette[::-1])
    rows = np.random.RandomState(6).randint(0, 256, 40 * 90 * 3).astype(np.uint8).tobytes()
    return {
        "noise 60x90": _encoded(_noise(1, 60, 90)), "noise 100x80": _encoded(_noise(2, 100, 80)),
        "jpeg 70x70": _encoded(_noise(3, 70, 70), "JPEG"), "grey 64x48": _encoded(_noise(4, 64, 48, "L")),
        "rgba 50x70": _encoded(_noise(7, 50, 70, "RGBA")),
        "palette warm": _encoded(warm), "palette cool": _encoded(cool),
        "bytes 90x40": _encoded(Image.frombytes("RGB", (90, 40), rows)),
        "bytes 40x90": _encoded(Image.frombytes("RGB", (40, 90), rows)),
    }


def image_message(text: str, *urls: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}


def hostile_images() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """Chats with images that must be refused (a 4xx JSON error each), as soak_server.BAD's rows."""
    png = good_images()["noise 60x90"]
    urls = {"truncated PNG": data_url(png[: len(png) // 2]), "bomb header": data_url(header_only_png(20_000, 20_000)),
            "undecodable image": data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
            "not an image": data_url(b"just some text"), "bad base64": "data:image/png;base64,%%%not-base64%%%",
            "remote image": "https://example.com/cat.png", "1x1 image": data_url(_encoded(_noise(8, 1, 1)))}
    rows = [(what, "/v1/chat/completions", json.dumps({"messages": [image_message("what is this", url)],
                                                       "max_tokens": 4}).encode(), JSON)
            for what, url in urls.items()]
    nine = json.dumps({"messages": [image_message("many", *[data_url(png)] * 9)], "max_tokens": 4}).encode()
    return [*rows, ("nine images", "/v1/chat/completions", nine, JSON)]


def vlm_jobs(export: Path, seed: int) -> list[dict[str, Any]]:
    """The vision-language export's good chats and their solo greedy answers (Generator.chat, one at a time, with
    the same messages, data URLs included)."""
    from kvforge.runtime import Generator

    generator = Generator(export)
    rng = random.Random(seed)
    questions = ["What is in this picture?", "Describe it.", "Which colours?", "Is it a cat?", "Count the shapes."]
    images = good_images()
    conversations: list[list[dict[str, Any]]] = []
    for name, data in images.items():
        conversations.append([image_message(f"{rng.choice(questions)} ({name})", data_url(data))])
        conversations.append([{"role": "system", "content": "Answer briefly."},
                              image_message(rng.choice(questions), data_url(data))])
    names = list(images)
    for i in range(4):  # two images in one message
        first, second = rng.sample(names, 2)
        conversations.append([image_message(f"Compare them {i}.", data_url(images[first]), data_url(images[second]))])
    for i in range(3):  # an image in an earlier turn
        look = image_message("Look at this.", data_url(images[names[i]]))
        answer = generator.chat([look], max_new_tokens=6, greedy=True).text[0]
        conversations.append([look, {"role": "assistant", "content": answer}, {"role": "user", "content": "And now?"}])
    conversations.append([{"role": "user", "content": "No picture this time."}])
    jobs = []
    for messages in conversations:
        max_tokens = rng.randint(4, 16)
        want = generator.chat(messages, max_new_tokens=max_tokens, greedy=True).text[0]
        jobs.append({"kind": "chat", "body": {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                     "want": want})
    return jobs



def text_only_images() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """A legal image sent to a text-only export: refused (4xx), as soak_server.BAD's rows."""
    body = {"messages": [image_message("what is this", data_url(good_images()["noise 60x90"]))], "max_tokens": 4}
    return [("image to a text-only export", "/v1/chat/completions", json.dumps(body).encode(), JSON)]
