"""A new user's first hour (issue 36): the built-in recipes listed and exported, path errors said before torch
loads, a quantised export without library tracebacks, hints that point somewhere useful, and messages
that agree with each other."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from kvforge.cli import dequantised_hint, main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def kvforge_subprocess(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: its own process (the logging setup and stderr are its own). Not from the
    repository root, whose folders would shadow the installed package layout."""
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# -- kvforge recipes, kvforge export --recipe ---------------------------------------------------------------
def test_recipes_lists_every_recipe_with_its_description() -> None:
    from kvforge.models.recipes import RECIPES

    code, out, _ = run("recipes")
    assert code == 0
    for name, recipe in RECIPES.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(recipe.model_type)} +{re.escape(recipe.description)}$",
                         out, re.MULTILINE), name
    assert "kvforge export --recipe NAME -o OUT_DIR" in out and "RANDOM" in out
    code, out, _ = run("recipes", "--json")
    listed = json.loads(out)["recipes"]
    assert code == 0 and [r["name"] for r in listed] == list(RECIPES)
    assert listed[0] == {"name": "llama-tiny", "model_type": "llama", "description": RECIPES["llama-tiny"].description,
                         "random_weights": True}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "OUT"], "give MODEL_DIR (a Hugging Face model folder or a .gguf file) or --recipe NAME"),
        (["MODEL", "--recipe", "llama-tiny", "-o", "OUT"], "give MODEL_DIR or --recipe NAME, not both"),
        (["--recipe", "llama-huge", "-o", "OUT"], "unknown recipe 'llama-huge'; choose one of llama-tiny, "),
    ],
    ids=["neither", "both", "unknown"],
)
def test_export_takes_a_model_or_a_recipe(args, message, tmp_path) -> None:
    args = [str(tmp_path / a) if a in ("OUT", "MODEL") else a for a in args]
    code, out, err = run("export", *args)
    assert code == 2 and err.startswith("kvforge: error: ") and err.count("\n") == 1, err
    assert message in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_export_recipe_builds_its_folder_beside_the_output_and_exports_it(tmp_path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "tiny"
    code, stdout, err = run("export", "--recipe", "llama-tiny", "-o", str(out))
    assert code == 0, err
    hf = tmp_path / "tiny.hf"
    assert f"building the built-in recipe 'llama-tiny' (random weights) in {hf}" in err
    assert json.loads((hf / "kvforge_recipe.json").read_text())["recipe"] == "llama-tiny"
    manifest = json.loads((out / "kvforge.json").read_text())
    assert manifest["model"]["source"] == str(hf.resolve())
    assert stdout.startswith(f"exported LlamaForCausalLM (ort, fp32) to {out}")
    # Exported again: the recipe's folder is reused, not rebuilt.
    code, _, err = run("export", "--recipe", "llama-tiny", "-o", str(out), "--force")
    assert code == 0 and f"reusing the built-in recipe 'llama-tiny' in {hf}" in err and "building" not in err


# -- quantised export: no library stack traces ------------------------------------------------------------
def test_a_quantised_export_prints_no_library_logging(hf_folder, tmp_path) -> None:
    model = hf_folder("llama-tiny")
    result = kvforge_subprocess("export", str(model), "-o", str(tmp_path / "int4"), "--quantize", "int4", "--quant-method", "rtn",
                                "--lm-head-bits", "8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Stack (most recent call last)" not in result.stderr
    assert "[INFO]" not in result.stderr and "RuntimeWarning" not in result.stderr, result.stderr
    assert all(line.startswith("[kvforge] ") for line in result.stderr.splitlines()), result.stderr
    # ... and the report names the quantisation, not only the activations' dtype.
    assert result.stdout.startswith(f"exported LlamaForCausalLM (ort, fp32, int4 weights, 8-bit lm_head) to "
                                    f"{tmp_path / 'int4'}")


def test_the_quantisers_import_leaves_the_root_logger_as_it_was(tmp_path) -> None:
    pytest.importorskip("onnx_ir")
    code = textwrap.dedent("""
        import logging, warnings
        from kvforge.exporter.quantization.matmuls import quantizer_class
        quantizer_class()
        root = logging.getLogger()
        print(root.level, len(root.handlers))
        logging.getLogger("some.library").warning("a real warning is still shown")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(30), "0"]  # WARNING, no handler: as Python starts
    assert "a real warning is still shown" in result.stderr


# -- generate on a model folder ---------------------------------------------------------------------------
def test_generate_on_a_model_folder_suggests_exporting_it_elsewhere(hf_folder) -> None:
    folder = hf_folder("llama-tiny")
    code, _, err = run("generate", str(folder), "--prompt", "hi")
    assert code == 2
    assert (f"{folder} is a Hugging Face model folder, not a kvforge export: export it first "
            f"(`kvforge export {folder} -o {folder}-export`) and pass that folder") in err
    assert f"-o {folder}`" not in err


# -- export's path errors, before torch loads -------------------------------------------------------------
PATH_CASES = {
    "typo": ("modle", None, "{path} does not exist; pass a local Hugging Face model folder or a .gguf file "
                            "(kvforge downloads nothing)"),
    # A Hub id is taken from huggingface_hub's cache (tests/exporter/test_hub_ids.py); offline and not cached, said so.
    "hub-id": ("HuggingFaceTB/SmolLM2-135M", None,
               "HuggingFaceTB/SmolLM2-135M: no such local path, and not in the Hugging Face cache ({cache}); "
               "HF_HUB_OFFLINE is set, so nothing is downloaded: run `hf download HuggingFaceTB/SmolLM2-135M` where "
               "the network is allowed, or pass a local model folder"),
    "a-file": ("weights.bin", "file", "{path} is a file but not a .gguf file; pass a local Hugging Face model "
                                      "folder (with config.json) or a .gguf file"),
    "no-config": ("empty", "folder", "{path} has no config.json: not a Hugging Face model folder (nor a folder "
                                     "with one .gguf file); pass the folder that holds config.json"),
}


def _make_path_case(tmp_path, name: str, kind: str | None):
    path = tmp_path / name
    if kind == "file":
        path.write_bytes(b"\0" * 16)
    elif kind == "folder":
        path.mkdir()
    return path


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_export_says_what_is_wrong_with_the_model_path(case, tmp_path, monkeypatch) -> None:
    pytest.importorskip("torch")  # without the export extra, export says to install it first
    name, kind, message = PATH_CASES[case]
    _make_path_case(tmp_path, name, kind)
    monkeypatch.chdir(tmp_path)  # a hub id is a relative path that does not exist here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, _, err = run("export", name, "-o", str(tmp_path / "out"))
    assert code == 2 and err.count("\n") == 1, err
    assert message.format(path=name, cache=tmp_path / "hub") in err, err
    assert not (tmp_path / "out").exists()


def test_export_checks_the_model_path_before_torch_loads(tmp_path) -> None:
    pytest.importorskip("torch")  # installed, yet not loaded by these errors
    for name, kind, _message in PATH_CASES.values():
        _make_path_case(tmp_path, name, kind)
    code = textwrap.dedent(f"""
        import json, sys, time
        from click.testing import CliRunner
        from kvforge.cli import main
        started = time.perf_counter()
        codes = [CliRunner().invoke(main, ["export", name, "-o", "out"]).exit_code for name in {[n for n, _, _ in PATH_CASES.values()]!r}]
        print(json.dumps({{"codes": codes, "seconds": time.perf_counter() - started,
                          "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules)}}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Neither torch nor transformers loaded: the path is checked first (it was 6-8 s each, torch loading first).
    # No timed assertion: on a shared machine the seconds swing; what is loaded says the order.
    assert report["codes"] == [2] * len(PATH_CASES) and report["loaded"] == []


# -- the tensorrt backend's hints -------------------------------------------------------------------------
def test_the_cuda_python_hint_names_the_backend_and_a_gpu_machine(monkeypatch) -> None:
    from kvforge.core import cuda
    from kvforge.core.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as where cuda-python is not installed
    with pytest.raises(BackendUnavailableError) as caught:
        cuda.device_count()
    message = str(caught.value)
    assert "trt backend" not in message
    assert message == (
        "the tensorrt backend (and serving on ort-cuda) runs on an NVIDIA GPU through cuda-python (cuda.bindings), "
        "which is not installed: on a machine with an NVIDIA GPU and its driver, pip install -e '.[trt]' "
        "(TensorRT and cuda-python; -e '.[gpu]' for ort-cuda); `kvforge doctor` shows what runs here")


# -- small things ---------------------------------------------------------------------------------------------
def test_the_dequantised_gguf_hint_says_int4_requantises() -> None:
    manifest = {"dtype": "fp32", "files": {"model.weights": {"bytes": 538_000_000}},
                "model": {"source_gguf": {"bytes": 98_362_432, "tensor_types": {"F32": 61, "Q5_1": 210}}}}
    assert dequantised_hint(manifest) == (
        "note: the GGUF's Q5_1 weights (98.4 MB) were dequantised to fp32 (538.0 MB); --quantize int4 (target ort) "
        "re-quantises them to 4 bits (round-to-nearest, blocks of 32: not the GGUF's own blocks)")
    manifest["model"]["source_gguf"]["tensor_types"] = {"F32": 61, "Q4_0": 150, "Q6_K": 60}
    assert dequantised_hint(manifest).endswith(
        "--quantize int4 (target ort) carries its Q4_0 blocks over as they are and re-quantises the rest to 4 bits "
        "(round-to-nearest)")


def test_progress_says_it_is_still_working_when_not_on_a_terminal(monkeypatch) -> None:
    from kvforge.core import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.1)
    out = io.StringIO()
    say = progress.StepProgress(stream=out)
    say("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it")
    time.sleep(0.5)
    say("lowering prefill attention for target ort")
    say.close()
    time.sleep(0.3)  # nothing after close
    lines = out.getvalue().splitlines()
    assert lines[-1].endswith("lowering prefill attention for target ort"), lines
    beats = lines[1:-1]
    assert len(beats) >= 2, lines
    assert all(re.fullmatch(r"\[kvforge\] \[\s*[\d.]+s\] still tracing the model once \(\d+ s\)", b) for b in beats)
    after = io.StringIO()  # a report of a finished step is not said to be still running
    say = progress.StepProgress(stream=after)
    say("exported to /tmp/x: load, trace, optimise and write took 7.0 s")
    time.sleep(0.25)
    say.close()
    assert re.search(r"\] still working \(\d+ s after: exported to /tmp/x\)$", after.getvalue(), re.MULTILINE), \
        after.getvalue()
    quiet = io.StringIO()
    say = progress.StepProgress(quiet=True, stream=quiet)
    say("tracing")
    time.sleep(0.25)
    say.close()
    assert quiet.getvalue() == ""


def test_parity_says_how_many_of_the_texts_tokens_it_scores(hf_folder, exported) -> None:
    code, out, err = run("parity", str(hf_folder("llama-tiny")), str(exported("llama-tiny")), "--new-tokens", "2",
                         "--prompt", "hello", "--perplexity-tokens", "300")
    assert code == 0, err
    assert ("perplexity on the first 300 tokens of perplexity.txt, in windows of 256 (each window's first token "
            "is context, not scored: 298 scored)") in err
    assert "perplexity on 298 scored tokens (the first 300 of perplexity.txt, windows of 256): " in out


def test_serve_says_replica_in_the_singular() -> None:
    from kvforge.cli.run import serving_where

    assert serving_where(True, 1) == "1 Ray Serve replica"
    assert serving_where(True, 3) == "3 Ray Serve replicas"
    assert serving_where(False, 2) == "one process"


def test_the_demo_says_converted_once_and_reports_the_exporters_time(tmp_path, monkeypatch, hf_folder) -> None:
    """The demo's GGUF path on a stand-in GGUF whose 'conversion' is the tiny Llama with a chat template."""
    gguf = pytest.importorskip("gguf")
    import importlib

    from kvforge.models import gguf as kv_gguf

    demo = importlib.import_module("kvforge.cli.demo")  # `kvforge.cli.demo` the attribute is the click command
    from gguf_tiny import stand_in_gguf
    from shared_exports import CHAT_TEMPLATE

    source = stand_in_gguf(gguf, tmp_path / "tiny.gguf")

    def convert(_gguf_path, out, _say) -> None:
        shutil.copytree(hf_folder("llama-tiny"), out, dirs_exist_ok=True)
        (out / "kvforge_recipe.json").unlink()
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    monkeypatch.setattr(kv_gguf, "_convert", convert)
    monkeypatch.setattr(demo, "installed_real_model", lambda: source)
    said: list[str] = []
    info = demo.run_demo(tmp_path / "demo", max_new_tokens=2, say=said.append)
    assert [m for m in said if m.startswith("converting ")], said
    assert not [m for m in said if "reusing" in m], said
    took = [m for m in said if m.startswith("exported to ")]
    assert len(took) == 1, said
    exporter = re.search(r"write took ([\d.]+) s; converting the GGUF before it took ([\d.]+) s", took[0])
    assert exporter is not None, took
    assert (f"{info['export_s']:.1f}", f"{info['convert_s']:.1f}") == exporter.groups()


def test_build_says_when_it_replaces_engines_built_with_other_options(exported, tmp_path) -> None:
    pytest.importorskip("tensorrt_rtx", reason="needs TensorRT for RTX: pip install -e '.[trt-rtx]'")
    folder = shutil.copytree(exported("llama-tiny", "onnx", "fp16"), tmp_path / "export")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    code, _, err = run("build", str(folder), "--max-seq-len", "32", "--max-batch", "2")
    assert code == 0, err
    code, out, err = run("build", str(folder), "--max-seq-len", "32", "--single-engine", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["replaced"] == {"options": {"max_batch": [2, 1], "single_engine": [False, True]}}
    code, _, err = run("build", str(folder), "--max-seq-len", "32")
    assert code == 0, err
    assert f"replacing the engines in {folder / 'engines'}, built with other options (single_engine True -> False)" \
        in err


def test_a_bare_kvforge_prints_its_help_and_a_usage_error_says_where_the_usage_is() -> None:
    # A bare `kvforge`: the help as `--help` prints it (click 8.2 raises it as an error), exit 0.
    code, out, err = run()
    assert code == 0 and re.match(r"Usage: \S+ \[OPTIONS\] COMMAND", out) and "\n  export " in out and not err
    result = CliRunner().invoke(main, ["export"], prog_name="kvforge")
    code, err = result.exit_code, result.stderr
    assert code == 2 and err.strip() == ("kvforge: error: Missing option '-o' / '--output'. "
                                         "(kvforge export --help shows its usage)")


def test_parity_refuses_a_model_dir_that_is_not_the_exports_model(hf_folder, exported, tmp_path) -> None:
    export = str(exported("llama-tiny"))
    # Another architecture with the same vocabulary: was reported as a parity failure of the export.
    code, _, err = run("parity", str(hf_folder("qwen2-tiny")), export)
    assert code == 2 and err.startswith(f"kvforge: error: {hf_folder('qwen2-tiny')} is not the model {export} was "
                                        "exported from (model_type llama in the export, qwen2 in qwen2-tiny)"), err
    assert "The order is MODEL_DIR EXPORT_DIR" in err
    # Another vocabulary: failed in numpy ("operands could not be broadcast").
    other = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "bigger-vocab")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    code, _, err = run("parity", str(other), export)
    assert code == 2 and "(vocab_size 512 in the export, 1024 in bigger-vocab)" in err, err
    # Swapped: the export first. It was told to export the model folder first (issue 43, 22).
    code, _, err = run("parity", export, str(hf_folder("llama-tiny")))
    assert code == 2 and err.startswith(f"kvforge: error: {export} is a kvforge export and {hf_folder('llama-tiny')} "
                                        "is not: the arguments are swapped? The order is MODEL_DIR EXPORT_DIR: "
                                        f"kvforge parity {hf_folder('llama-tiny')} {export}"), err


@pytest.mark.parametrize(("args", "says"), [
    (["export", "MODEL", "-o", "OUT", "--block-size", "64"], "--block-size goes with --quantize, which is not given"),
    (["export", "MODEL", "-o", "OUT", "--accuracy-level", "4", "--quant-method", "rtn"],
     "--accuracy-level, --quant-method go with --quantize, which is not given"),
    (["generate", "EXPORT", "--prompt-ids", "1,2", "--draft-len", "3"], "--draft-len goes with --speculate"),
    (["bench", "EXPORT", "--draft-len", "3"], "--draft-len goes with --speculate"),
    (["generate", "EXPORT", "--prompt-ids", "1,2", "--greedy", "--temperature", "0.5"],
     "greedy decoding ignores temperature=0.5; ask for one: greedy (--greedy, greedy=True) or sampling"),
    (["generate", "EXPORT", "--prompt-ids", "1,2", "--temperature", "-1"],
     "temperature must be > 0, got -1.0; for deterministic decoding ask for greedy (--greedy, greedy=True; "
     "temperature 0 over HTTP)"),
], ids=["block-size", "accuracy-level", "draft-len generate", "draft-len bench", "greedy+temperature", "temperature"])
def test_options_that_would_be_ignored_are_refused(args, says, hf_folder, exported, tmp_path) -> None:
    # They were ignored without a word (issue 43, 8 and 9).
    swap = {"MODEL": str(hf_folder("llama-tiny")), "OUT": str(tmp_path / "out"), "EXPORT": str(exported("llama-tiny"))}
    code, _, err = run(*[swap.get(a, a) for a in args])
    assert code == 2 and says in err, err
    assert not (tmp_path / "out").exists()


def test_the_python_api_refuses_greedy_with_a_temperature(exported) -> None:
    from kvforge.core.errors import InputError
    from kvforge.runtime import Generator

    generator = Generator(exported("llama-tiny"))
    with pytest.raises(InputError, match="greedy decoding ignores temperature=0.7"):
        generator.generate([[1, 2]], max_new_tokens=2, greedy=True, temperature=0.7)
    # The filters' "off" values are not a request to sample (the server passes them so).
    assert generator.generate([[1, 2]], max_new_tokens=2, greedy=True, top_p=1.0, top_k=0).tokens[0]


def test_a_recipe_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    # Was "unexpected SafetensorError" and an empty folder left behind (issue 43, 6).
    from safetensors import SafetensorError

    from kvforge.models import recipes

    class Unsaveable:
        def save_pretrained(self, *args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(recipes, "build_model", lambda name, seed=0: Unsaveable())
    code, _, err = run("demo", "--recipe", "demo-llama", "-o", str(tmp_path / "d"))
    errors = [line for line in err.splitlines() if line.startswith("kvforge: error:")]
    assert code == 2 and len(errors) == 1 and "unexpected" not in err, err
    assert "no space left" in err.lower() and str(tmp_path / "d") in err, err
    assert not (tmp_path / "d").exists()


def test_a_failed_export_of_a_recipe_removes_the_recipe_folder_it_built(tmp_path, monkeypatch) -> None:
    # It said nothing was changed, and left the complete recipe folder behind (issue 43, 6).
    from kvforge.core.errors import ExportError
    from kvforge.exporter import export

    def failing(*args, **kwargs):
        raise ExportError("export of the recipe failed: the disk is full; nothing was changed")

    monkeypatch.setattr(export, "export_model", failing)
    code, _, err = run("export", "--recipe", "llama-tiny", "-o", str(tmp_path / "out"))
    assert code == 2 and "nothing was changed" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("prompts", "options", "says"), [
    (5, {}, "prompts must be a str, a list of str, or a list of token-id lists, got int 5"),
    ({"a": 1}, {}, "prompts must be a str, a list of str, or a list of token-id lists, got dict {'a': 1}"),
    ([[1, 2]], {"temperature": float("inf")}, "temperature must be a finite number > 0, got inf"),
    ([[1, 2]], {"stop_token_ids": [7, 10**6]}, "stop_token_ids [1000000] are not token ids of this model (0..511)"),
], ids=["int", "dict", "temperature inf", "stop id outside"])
def test_the_python_api_names_what_is_wrong(exported, prompts, options, says) -> None:
    # They said "the prompt is empty", or were accepted (issue 43, 10).
    from kvforge.core.errors import InputError
    from kvforge.runtime import Generator

    with pytest.raises(InputError) as err:
        Generator(exported("llama-tiny")).generate(prompts, max_new_tokens=2, **options)
    assert says in str(err.value)
