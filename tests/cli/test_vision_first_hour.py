"""A newcomer tries a vision-language model offline, following README.md and docs/vision.md as written: the
`llava-tiny` recipe (LLaVA-1.5's layout, its chat template, random weights) exported with `kvforge export
--recipe`, asked about the shipped sample picture with `generate --image`, `chat`'s `/image` and the `openai`
client against `kvforge serve` (issue 53, first hour 1-2). Beside them: `chat --chat-template FILE` (as serve's),
`generate --chat --image` rendering the image where the template puts it, `inspect` naming the whole model, and
`--target trt` refused from config.json alone (first hour, low).

The pages' commands run verbatim with bash in a fresh folder that holds `kvforge/data/sample.png` (the sample's
path in a checkout, linked to this checkout's file); their Python runs with `python -P`, so that folder's
`kvforge/` does not shadow the installed package.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_readme_examples import ROOT, _serving, doc_block  # noqa: E402

from kvforge.cli import main  # noqa: E402

pytestmark = pytest.mark.xdist_group("vision-language")
EXPORT_LINE = "kvforge export --recipe llava-tiny -o llava-ort"
VISION = "docs/vision.md"


def _bash(line: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{line}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    return result


def _python(script: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-P", "-c", script], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    return result


def _readme_lines() -> list[str]:
    return doc_block(EXPORT_LINE).strip().splitlines()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vlm-first-hour")
    (folder / "kvforge" / "data").mkdir(parents=True)
    (folder / "kvforge" / "data" / "sample.png").symlink_to(ROOT / "kvforge" / "data" / "sample.png")
    return folder


@pytest.fixture(scope="module")
def exported(workdir) -> subprocess.CompletedProcess:
    """README's first VLM command, as written: the recipe built and exported in `workdir`."""
    line = _readme_lines()[0]
    assert line.startswith(EXPORT_LINE)
    return _bash(line, workdir)


def test_readme_and_vision_page_ask_the_tiny_llava_about_the_sample_picture(workdir, exported) -> None:
    assert "exported LlavaForConditionalGeneration with vision.onnx (ort, fp32) to llava-ort" in exported.stdout
    assert (workdir / "llava-ort" / "vision.onnx").is_file() and (workdir / "llava-ort.hf" / "chat_template.jinja").is_file()
    # docs/vision.md shows README's three commands as they are.
    assert doc_block(EXPORT_LINE, VISION) == doc_block(EXPORT_LINE)
    export, generate, chat = _readme_lines()
    assert "--image kvforge/data/sample.png" in generate and "/image kvforge/data/sample.png" in chat
    asked = _bash(generate, workdir)
    assert re.search(r"\d+ tokens generated", asked.stderr) and asked.stdout.strip(), asked
    # The --prompt line with bash's $'...' (a real newline) gives the --chat line's tokens, so the same text.
    prompted = _bash(doc_block("--prompt $'USER: <image>", VISION).strip(), workdir)
    assert prompted.stdout == asked.stdout
    chatted = _bash(chat, workdir)
    assert re.search(r"^\[\d+ tokens, 0 of \d+ prompt tokens cached", chatted.stderr, re.M), chatted.stderr
    assert chatted.stdout.strip()


def test_vision_pages_python_example_runs(workdir, exported) -> None:
    printed = _python(doc_block('image = "kvforge/data/sample.png"', VISION), workdir).stdout
    assert printed.strip()


def test_vision_pages_openai_client_asks_kvforge_serve(workdir, exported) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from kvforge.runtime import Generator

    serve = doc_block("kvforge serve llava-ort --port", VISION).strip()
    client = doc_block("base64.b64encode", VISION)
    with _serving(serve, workdir):
        answer = _python(client, workdir).stdout
    # The server's answer is the Generator's for the same message (greedy: the recipe's generation config).
    image = str(workdir / "kvforge" / "data" / "sample.png")
    want = Generator(workdir / "llava-ort").chat([{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "What is in this picture?"}]}], max_new_tokens=24)
    assert answer == want.text[0] + "\n"


def test_inspect_names_the_whole_vision_language_model(workdir, exported) -> None:
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["inspect", str(workdir / "llava-ort")])
    assert out.exit_code == 0, out.output
    first = out.stdout.splitlines()[0]
    assert first.startswith(f"{workdir / 'llava-ort'}: LlavaForConditionalGeneration (text model LlamaForCausalLM, ")
    assert "LlavaForConditionalGeneration (text model LlamaForCausalLM" in (ROOT / VISION).read_text()


def test_generate_chat_puts_the_image_where_the_template_says(workdir, exported) -> None:
    from click.testing import CliRunner

    image = str(workdir / "kvforge" / "data" / "sample.png")
    common = ["--image", image, "--greedy", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    folder = str(workdir / "llava-ort")
    chat = CliRunner().invoke(main, ["generate", folder, "--chat", "What is shown?", *common])
    prompt = CliRunner().invoke(main, ["generate", folder, "--prompt", "USER: <image>\nWhat is shown? ASSISTANT:",
                                       *common])
    assert chat.exit_code == 0 and prompt.exit_code == 0, chat.output + prompt.output
    # LLaVA-1.5's template writes "USER: <image>\n" then the question: the image is not put before "USER:".
    assert json.loads(chat.stdout)["tokens"] == json.loads(prompt.stdout)["tokens"]


def test_chat_takes_a_chat_template_file_as_serve_does(workdir, exported, tmp_path) -> None:
    from click.testing import CliRunner
    from serving import with_template

    from kvforge.runtime import Generator

    template = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    (tmp_path / "qa.jinja").write_text(template)
    folder = workdir / "llava-ort"
    out = CliRunner().invoke(main, ["chat", str(folder), "--chat-template", str(tmp_path / "qa.jinja"), "--greedy",
                                    "--ignore-eos", "--max-new-tokens", "8", "--json", "--quiet"], input="Hello\n")
    assert out.exit_code == 0, out.output
    # The same turn with that template inside the export (as if it had come with the model).
    want = Generator(with_template(folder, tmp_path / "with-template", template)).chat(
        "Hello", greedy=True, ignore_eos=True, max_new_tokens=8)
    assert json.loads(out.stdout.splitlines()[0])["answer"] == want.text[0]
    missing = CliRunner().invoke(main, ["chat", str(folder), "--chat-template", str(tmp_path / "none.jinja")],
                                 input="Hello\n")
    assert missing.exit_code == 2 and "cannot read the chat template" in missing.output
    assert len(missing.output.strip().splitlines()) == 1


def test_trt_refuses_a_vision_language_checkpoint_from_its_config_alone(workdir, exported, tmp_path,
                                                                        monkeypatch) -> None:
    import kvforge.exporter.export as export
    from kvforge.core.errors import UnsupportedModelError

    def loaded(*_args, **_kwargs):
        raise AssertionError("the model's config was loaded through transformers before the refusal")

    monkeypatch.setattr(export, "load_hf_config", loaded)
    with pytest.raises(UnsupportedModelError, match=r"llava: a vision-language model, and --target trt takes no "
                                                    r"images yet .* --target ort or --target onnx, or with --text-only"):
        export.export_model(workdir / "llava-ort.hf", tmp_path / "trt", target="trt")
    assert not (tmp_path / "trt").exists()


def test_the_recipe_sample_picture_and_template(workdir, exported) -> None:
    from PIL import Image
    from transformers import AutoTokenizer

    from kvforge.models.recipes import FAMILY_RECIPES, LLAVA_CHAT_TEMPLATE, RECIPES, SAMPLE_IMAGE

    assert "llava-tiny" in RECIPES and "llava-tiny" not in FAMILY_RECIPES  # not a text family's parity recipe
    with Image.open(SAMPLE_IMAGE) as picture:
        assert picture.format == "PNG" and picture.size == (128, 96)
    assert SAMPLE_IMAGE.stat().st_size < 4096
    # (tests/core/test_packaging.py checks that an install holds it.)
    # The recipe's tokenizer carries the template, which renders LLaVA-1.5's prompt (its model card's) from
    # transformers' content parts, and text turns.
    tokenizer = AutoTokenizer.from_pretrained(workdir / "llava-ort.hf")
    assert tokenizer.chat_template == LLAVA_CHAT_TEMPLATE

    def rendered(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    assert rendered(parts) == "USER: <image>\nWhat is shown? ASSISTANT:"
    turns = [*parts, {"role": "assistant", "content": "A house."}, {"role": "user", "content": "And the sky?"}]
    assert rendered(turns) == "USER: <image>\nWhat is shown? ASSISTANT: A house. USER: And the sky? ASSISTANT:"


def test_the_demo_asks_the_vision_language_recipe_about_the_sample_picture(tmp_path) -> None:
    from kvforge.cli.demo import RANDOM_PROMPT, run_demo
    from kvforge.models.recipes import SAMPLE_IMAGE
    from kvforge.runtime import Generator

    info = run_demo(tmp_path / "demo", recipe="llava-tiny", max_new_tokens=6)
    assert info["image"] == str(SAMPLE_IMAGE) and info["next"].endswith(f"--image {SAMPLE_IMAGE}")
    want = Generator(info["export_dir"]).generate(RANDOM_PROMPT, images=[SAMPLE_IMAGE], max_new_tokens=6,
                                                 ignore_eos=True)
    assert info["tokens"] == want.tokens[0]
    text_only = Generator(info["export_dir"]).generate(RANDOM_PROMPT, max_new_tokens=6, ignore_eos=True)
    assert text_only.tokens[0] != want.tokens[0]  # the picture was part of the prompt
