"""Bad image input to a vision-language export is an HTTP 400 over the server and one InputError line from the
Python API (exit 2 and one line from the CLI), each naming the limit, on the families of test_vlm_serving.py (the same
exports, made once): an image over the pixel budget, an image place without its image (and an image without its
place), too many images, an image too long for its width. The pixel budget that refuses is the decode limit
(ImageLimits.max_pixels, checked from the header before decoding); a family's own pixel bounds (Qwen's max_pixels,
InternVL's max_patches) resize an image down as their processors do, so an image over them is no error: it takes
the most tokens the family gives an image. Videos are left to their own tests."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import data_url, header_only_png  # noqa: E402
from vlm_served import MODEL, chat, message, png, served_app, served_export  # noqa: E402

pytestmark = pytest.mark.xdist_group("vlm-served")  # the exports of test_vlm_serving.py, on its worker
FAMILIES = ("qwen2_5_vl", "internvl")
BOMB = header_only_png(20_000, 20_000)  # 400 M pixels by its header
BUDGET = "over the limit of 40000000 pixels"


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    folder = served_export(tmp_path_factory, request.param)
    with served_app(folder) as (base, app):
        yield request.param, folder, base, app


def _refused(base: str, app, messages: list[dict], says: str) -> str:
    """The 400's message for `messages`, which names `says`; nothing is left running."""
    with pytest.raises(openai.BadRequestError) as caught:
        chat(base, messages)
    assert caught.value.status_code == 400
    text = str(caught.value)
    assert says in text, text
    snapshot = app.state.service.scheduler.snapshot()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0
    return text


@pytest.mark.parametrize("case, says", [
    ("over the pixel budget", BUDGET),
    ("too many images", "9 images in one request; this server takes at most 8"),
    ("an image without its place", "wrote 0 image place(s)"),
    ("too long for its width", "more than 200 times as long as"),
])
def test_bad_images_over_the_api_are_400s_naming_the_limit(served, case, says):
    _, _, base, app = served
    url = data_url(png(1, 40, 60))
    messages = {
        "over the pixel budget": [message("what is this", data_url(BOMB))],
        "too many images": [message("many", *[url] * 9)],
        # The template drops system messages: the image there would be lost, so the request is refused.
        "an image without its place": [message("Look at this:", url, role="system"), message("what is it")],
        "too long for its width": [message("what is this", data_url(png(2, 3, 700)))],
    }[case]
    _refused(base, app, messages, says)
    assert isinstance(chat(base, [message("and this", url)]), str)  # the server goes on answering


def test_an_image_over_the_familys_own_budget_is_resized_down(served):
    """Qwen's max_pixels (28*28*36: 36 tokens at most) and InternVL's max_patches (4 tiles and a thumbnail) bound an
    image's tokens: a 1200x1200 image takes as many prompt tokens as one at the family's largest size."""
    from PIL import Image

    family, _, base, _ = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)

    def prompt_tokens(side: int) -> int:
        # Blocks of 8x8 pixels: a large image's PNG stays under the server's request size.
        image = np.kron(np.random.RandomState(3).rand(side // 8, side // 8, 3), np.ones((8, 8, 1)))
        buffer = io.BytesIO()
        Image.fromarray((image * 255).astype(np.uint8)).save(buffer, format="PNG")
        url = data_url(buffer.getvalue())
        reply = client.chat.completions.create(model=MODEL, messages=[message("what", url)],
                                               max_tokens=1, temperature=0)
        return reply.usage.prompt_tokens

    largest = 168 if family == "qwen2_5_vl" else 112  # 6x6 merged patches of 28 pixels; 2x2 tiles of 56
    assert prompt_tokens(1200) == prompt_tokens(largest) > prompt_tokens(40)


def test_the_python_api_says_the_same_in_one_line(served):
    from kvforge.core.errors import InputError
    from kvforge.runtime import Generator

    _, folder, _, _ = served
    gen = Generator(folder)
    small = png(4, 40, 60)
    cases = [
        ({"prompt": "what is <image>", "images": [BOMB]}, BUDGET),
        ({"prompt": "many " + "<image>" * 9, "images": [small] * 9}, "too many images: at most 8 per prompt"),
        ({"prompt": "two <image> places <image>", "images": [small]},
         "marks 2 image place(s) ('<image>') but comes with 1 image(s)"),
        ({"prompt": "what is <image>", "images": [png(5, 3, 700)]}, "more than 200 times as long as"),
    ]
    for options, says in cases:
        with pytest.raises(InputError) as caught:
            gen.generate(options["prompt"], images=options["images"], max_new_tokens=2)
        assert says in str(caught.value) and "\n" not in str(caught.value)
    system_image = [{"role": "system", "content": [{"type": "image", "image": small}]},
                    {"role": "user", "content": "what is it"}]
    with pytest.raises(InputError, match=r"wrote 0 image place\(s\)"):
        gen.chat(system_image, max_new_tokens=2)


def test_the_cli_says_it_in_one_line_and_exits_2(served, tmp_path):
    from click.testing import CliRunner

    from kvforge.cli import main

    _, folder, _, _ = served
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(BOMB)
    out = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "what is <image>", "--image", str(bomb)])
    assert out.exit_code == 2 and BUDGET in out.output and len(out.output.strip().splitlines()) == 1, out.output
