"""What `kvforge export` prints when it is done: the export, and what its quantisation costs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvforge.cli.common import dequantised_hint, export_kind


def print_export_summary(manifest: dict[str, Any], out_dir: Path, quantize: str | None, kv_cache: str | None) -> None:
    """The export's line, its accuracy check's figures (or why it was skipped), and a hint for dequantised input."""
    whole = manifest.get("vision") is not None  # a vision-language checkpoint exported whole: name it so
    name = manifest["model"]["text_of"]["architecture"] if whole else manifest["model"]["architecture"]
    click.echo(f"exported {name}{' with vision.onnx' if whole else ''} ({export_kind(manifest)}) to {out_dir}")
    section = "quantization" if quantize is not None else "kv_cache_quantization"
    quant = manifest.get(section)
    acc = quant.get("accuracy") if quant else None
    if acc and "skipped" in acc:
        click.echo(f"{quantize or 'KV cache ' + str(kv_cache)}: accuracy check skipped ({acc['skipped']})")
    elif acc:
        what = (f"{quantize}: {quant['matmuls_quantized']} matrices, weights {quant['weights_bytes'] / 1e6:.0f} MB"
                if quantize is not None else f"KV cache {kv_cache} (per-channel scales)")
        if quantize is not None and kv_cache is not None:
            what += f", KV cache {kv_cache}"
        perplexity = (f", perplexity {acc['perplexity']} vs {acc['reference_perplexity']} "
                      f"({100 * acc['perplexity_relative_increase']:+.2f}%)" if "perplexity" in acc else
                      " (the decoder's, teacher-forced)")  # an encoder-decoder's check has no perplexity
        click.echo(f"{what}; vs the fp32 model: max logit error {acc['max_abs_logit_err']}, greedy agreement "
                   f"{acc['greedy_agreement']}{perplexity}")
        if acc.get("note"):  # the prompts' answers part from the fp32 model's although the figures look close
            click.echo(f"note: {acc['note']}")
    hint = dequantised_hint(manifest)
    if hint:
        click.echo(hint, err=True)
