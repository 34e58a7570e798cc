"""Helpers of the VLM serving tests (test_vlm_serving.py, test_vlm_bad_input.py): a family's tiny checkpoint exported
once per run (shared by the xdist workers) with a chat template, an app over it on a real server, images and
OpenAI chat messages."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from serving import serving, with_template
from shared_exports import made_once, shared_folder
from vlm_testing import tiny_vlm_export

# A template that writes user and assistant turns and drops system messages (as many released templates drop what
# they do not know): an image part in a system message gets no place.
TEMPLATE = ("{% for m in messages %}{% if m.role != 'system' %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = "vlm"


def served_export(tmp_path_factory: Any, family: str) -> Path:
    """`family`'s tiny checkpoint (kvforge/tools/vlm_fixtures.py) exported whole (ort, fp32) with TEMPLATE, made once
    per test run."""
    def make(out: Path) -> None:
        out.mkdir()
        with_template(tiny_vlm_export(tmp_path_factory, family) / "export", out / "served", TEMPLATE)

    return made_once(shared_folder(tmp_path_factory, "vlm-served"), family, make) / "served"


@contextlib.contextmanager
def served_app(folder: Path, **options: Any) -> Iterator[tuple[str, Any]]:
    """The app over `folder` on a loopback port: (base URL, app)."""
    from kvforge.serve.app import create_app

    settings = {"max_batch": 8, "max_seq_len": 512, "model_name": MODEL, "prefill_chunk": 64, **options}
    app = create_app(folder, **settings)
    with serving(app) as base:
        yield base, app


def png(seed: int, height: int, width: int) -> bytes:
    """A noise image of height x width as PNG bytes."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    buffer = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def message(text: str, *urls: str, role: str = "user") -> dict:
    """A chat message of `text` followed by image_url parts."""
    return {"role": role, "content": [{"type": "text", "text": text},
                                      *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}


def chat(base: str, messages: list[dict], tokens: int = 12) -> str:
    """The greedy answer of the served model to `messages` (openai client; raises its errors)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens, temperature=0)
    return reply.choices[0].message.content
