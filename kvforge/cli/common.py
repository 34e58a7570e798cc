"""What the `kvforge` commands share: option choices from the registries, progress, JSON output,
and the small parsers and formatters of their messages."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvforge.core.errors import BackendUnavailableError, InputError
from kvforge.core.progress import StepProgress
from kvforge.runtime.backends.backend import REGISTRY as BACKENDS


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def require_export_extra(command: str) -> None:
    """The base install is the runtime; export/parity/demo need torch, transformers, onnxscript."""
    import importlib.util

    missing = [name for name in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"`kvforge {command}` needs the export extra ({', '.join(missing)} missing), in the kvforge checkout: "
            "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && pip install -e '.[export]'"
        )


def refuse_unused(needed: str, present: bool, *names: str) -> None:
    """A usage error for options given on the command line that only mean something with --`needed`
    (absent): they would be ignored without a word."""
    from click.core import ParameterSource

    context = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in names
             if context.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    if given and not present:
        raise click.UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --{needed}, which is "
                               "not given")


BACKEND_CHOICES = list(BACKENDS)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")

Command = TypeVar("Command", bound=Callable[..., Any])


def sampling_options(command: Command) -> Command:
    """--greedy, --temperature, --top-k, --top-p, --seed: the sampling options `generate` and `chat` share."""
    for option in reversed((
        click.option("--greedy", is_flag=True, help="Greedy decoding, whatever the folder's generation config says."),
        click.option("--temperature", type=float, help="Sample at this temperature (> 0) instead of the export's "
                     "default decoding."),
        click.option("--top-k", type=int, help="Sample among the k most likely tokens only (0: all)."),
        click.option("--top-p", type=float, help="Sample among the most likely tokens whose probabilities add up to p "
                     "(1: all)."),
        click.option("--seed", type=int, help="Sampling seed: the same seed gives the same tokens."),
    )):
        command = option(command)
    return command


def json_option(what: str) -> Callable[[Command], Command]:
    """--json: the command's result as one JSON object on stdout instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object instead of text.")


def revision_option(command: Command) -> Command:
    return click.option("--revision", default=None, metavar="REV",
                        help="With a Hugging Face Hub id (org/name) as MODEL_DIR: the branch, tag or commit to take "
                             "(default main).")(command)


def model_source(model_dir: Path | None, revision: str | None) -> Path | None:
    """MODEL_DIR as a local path: a Hub id (org/name) becomes its snapshot in huggingface_hub's cache, downloaded
    only where HF_HUB_OFFLINE is unset (kvforge.models.hub); a local path stays as it is (None: --recipe)."""
    if model_dir is None:
        if revision is not None:
            raise click.UsageError("--revision goes with a Hugging Face Hub id (org/name) as MODEL_DIR")
        return None
    from kvforge.models.hub import resolve_model

    return resolve_model(model_dir, revision, lambda message: click.echo(message, err=True))


def sampling_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """`Generator.request`'s sampling keywords from sampling_options' values; an option not given stays
    None so that the export folder's generation config decides."""
    return {"greedy": True if options["greedy"] else None, **{key: options[key] for key in SAMPLING_KEYS}}


NO_SPIN_HELP = "ONNX Runtime backends: threads sleep instead of spinning while they wait (a busy shared CPU)."


def no_spin_option(command: Command) -> Command:
    return click.option("--no-spin", is_flag=True, help=NO_SPIN_HELP)(command)


def emulation_option(command: Command) -> Command:
    return click.option("--emulation", type=click.Choice(["triton", "reference"]), default=None,
                        help="emulate backend: the Triton kernel under its interpreter (default) or the numpy "
                             "reference (no torch or triton needed).")(command)


def backend_options(**given: Any) -> dict[str, Any]:
    """The backend options the user actually gave (each backend has its own defaults)."""
    return {name: value for name, value in given.items() if value is not None}


def command_progress(quiet: bool) -> StepProgress:
    """Progress on stderr for this command (nothing with --json); closed when the command ends."""
    progress = StepProgress(quiet=quiet)
    context = click.get_current_context(silent=True)
    if context is not None:
        context.call_on_close(progress.close)
    return progress


def emit_json(payload: dict[str, Any]) -> None:
    click.echo(json.dumps(payload, indent=2, default=str))


def dequantised_hint(manifest: dict[str, Any]) -> str | None:
    """A quantised GGUF exported without --quantize grows to the export's dtype: say so and what to do."""
    gguf = manifest["model"].get("source_gguf") or {}
    quantized = sorted(t for t in gguf.get("tensor_types", {}) if t not in ("F32", "F16", "BF16"))
    if not quantized or manifest.get("quantization"):
        return None
    weights = sum(r["bytes"] for name, r in manifest["files"].items() if name.endswith(".weights"))
    from kvforge.exporter.quantization.gguf_blocks import CARRIED

    carried = [t for t in quantized if t in CARRIED]
    rounded = "re-quantises them to 4 bits (round-to-nearest, blocks of 32: not the GGUF's own blocks)"
    if carried:
        rest = "" if len(carried) == len(quantized) else " and re-quantises the rest to 4 bits (round-to-nearest)"
        rounded = f"carries its {'/'.join(carried)} blocks over as they are{rest}"
    return (f"note: the GGUF's {'/'.join(quantized)} weights ({human_bytes(gguf['bytes'])}) were dequantised to "
            f"{manifest['dtype']} ({human_bytes(weights)}); --quantize int4 (target ort) {rounded}")


def checkpoint_bits(model_dir: Path) -> str | None:
    """"int4"/"int8" for a pre-quantised checkpoint (exported with its own integers), None for any other input."""
    if not (Path(model_dir) / "config.json").is_file():
        return None
    from kvforge.exporter.quantization.prequantized_convert import prequantized_layout

    layout = prequantized_layout(Path(model_dir))
    return None if layout is None else f"int{layout.bits}"


def human_bytes(count: int) -> str:
    """1234 -> '1.2 KB', 269030016 -> '269.0 MB' (decimal units, as the sizes in README)."""
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def check_utf8(option: str, text: str | None) -> None:
    """Bytes that are not UTF-8 on the command line (`$'\\xff'`) reach Python as lone surrogates,
    which no tokenizer takes: say which option holds them, before loading anything."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(
            f"{option} is not valid UTF-8 text (undecodable bytes at character {err.start}); pass UTF-8 text"
        ) from None


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError as err:
        raise InputError(f"--prompt-ids expects comma-separated integer token ids, got {text!r}") from err


def stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader is gone (POLLERR on its write end). Without
    a file descriptor or poll() to ask, a BrokenPipeError is taken to be stdout's."""
    try:
        import select

        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return True


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on a closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass  # not a real file (a test runner's capture): nothing to flush at exit


def export_kind(manifest: dict[str, Any]) -> str:
    """'ort, fp32', with the quantisation where there is one: 'ort, fp32, int4 weights, 8-bit lm_head, int8 KV cache'."""
    parts = [manifest["target"], manifest["dtype"]]
    quant = manifest.get("quantization")
    if quant:
        parts.append(f"int{quant['bits']} weights" + (f" ({quant['quant_method']})" if quant.get("quant_method", "rtn") != "rtn" else ""))
        if quant.get("lm_head_bits") not in (None, quant["bits"]):
            parts.append(f"{quant['lm_head_bits']}-bit lm_head")
    kv = manifest.get("kv_cache_quantization")
    if kv:
        parts.append(f"{kv['dtype']} KV cache")
    return ", ".join(parts)


def recipe_source(recipe: str, out_dir: Path, hf_dir: Path | None, force: bool,
                   say: Any) -> tuple[Path, Path | None]:
    """The Hugging Face folder of a built-in recipe, built (or reused) beside the export, as a GGUF's
    conversion is: OUT_DIR.hf unless --hf-dir says where; and the folder again when it was built now."""
    from kvforge.core.manifest import MANIFEST_NAME
    from kvforge.core.output_folder import check_output
    from kvforge.models.recipes import recipe_folder

    out = Path(out_dir).absolute()
    folder = Path(hf_dir) if hf_dir is not None else out.parent / f"{out.name}.hf"
    check_output(out, [folder.absolute()], force=force, marker=MANIFEST_NAME)  # before the recipe is built
    return folder, folder if recipe_folder(recipe, folder, say) else None


def recipe_twin(model_dir: Path, out_dir: Path, quantize: str | None) -> tuple[str | None, Path | None]:
    """A pre-quantised recipe (llama-tiny-autoround) exports as any such checkpoint, with its integers: its bits,
    and its dequantised twin in OUT_DIR.dequantised.hf (OUT_DIR.hf holds the recipe). Others: (quantize, None)."""
    bits = checkpoint_bits(model_dir)
    if bits is None:
        return quantize, None
    out = Path(out_dir).absolute()
    return quantize or bits, out.parent / f"{out.name}.dequantised.hf"


def chat_template_option(command: Command) -> Command:
    """--chat-template FILE|chatml-tools: `serve` and `chat` render with it instead of the export's template."""
    return click.option("--chat-template", default=None, metavar="FILE|chatml-tools",
                        help="A Jinja chat template to use instead of the export's (chatml-tools: kvforge's ChatML "
                             "template with tools, for ChatML models such as SmolLM2).")(command)
