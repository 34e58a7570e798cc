"""What the `kvforge` commands share: option choices from the registries, progress, JSON output,
and the small parsers and formatters of their messages."""

from __future__ import annotations

import json
from typing import Any

import click

from kvforge.errors import BackendUnavailableError, InputError
from kvforge.progress import StepProgress
from kvforge.runtime.backend import REGISTRY as BACKENDS


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def require_export_extra(command: str) -> None:
    """The base install is the runtime; export/parity/demo need torch, transformers, onnxscript."""
    import importlib.util

    missing = [name for name in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"`kvforge {command}` needs the export extra ({', '.join(missing)} missing): "
            "pip install torch==2.13.0 && pip install 'kvforge[export]'"
        )


BACKEND_CHOICES = list(BACKENDS)


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
    return (f"note: the GGUF's {'/'.join(quantized)} weights ({human_bytes(gguf['bytes'])}) were dequantised to "
            f"{manifest['dtype']} ({human_bytes(weights)}); --quantize int4 (target ort) keeps them at 4 bits")


def human_bytes(count: int) -> str:
    """1234 -> '1.2 KB', 269030016 -> '269.0 MB' (decimal units, as the sizes in README)."""
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError as err:
        raise InputError(f"--prompt-ids expects comma-separated integer token ids, got {text!r}") from err


