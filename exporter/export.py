"""`kvforge export`: local HF folder -> prefill.onnx + decode.onnx (+ shared weights) + manifest.

HF model (exporter/load.py) --(one dynamo trace, attention routed through the kvforge op;
exporter/trace.py)--> canonical prefill graph --(clean-up and fusions; exporter/optimize.py)-->
--(decode derived; exporter/trace.py)--> lowering per target (exporter/lowering.py) --> saved
graphs and manifest (kvforge/core/manifest.py). Everything is written to a temporary sibling folder
and renamed into place at the end, so a failed export leaves nothing that looks valid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kvforge.core.contract import DTYPES, KV_CACHE_DTYPES, KVLayout
from kvforge.core.errors import ExportError, InputError, KvforgeError, UnsupportedModelError
from kvforge.core.manifest import MANIFEST_NAME, write_manifest
from kvforge.core.output_folder import (
    StagedFolder,
    check_output,
    disk_full,
    disk_full_error,
    fault_point,
    require_free_space,
)
from kvforge.exporter.checkpoint import open_checkpoint
from kvforge.exporter.export_manifest import WEIGHTS_NAME, export_manifest
from kvforge.exporter.graphs import ExportWork, MadeGraphs, make_graphs
from kvforge.exporter.load import check_model_path, check_weight_files, load_hf_config, one_line
from kvforge.exporter.options import ExportOptions
from kvforge.exporter.quantization import plan as quantization
from kvforge.exporter.targets import ExportTarget
from kvforge.exporter.text_model import text_family
from kvforge.exporter.weights import save_with_shared_weights
from kvforge.models.config_values import config_value
from kvforge.models.families import Family
from kvforge.models.gguf import GGUF_MARKER, convert_gguf, find_gguf
from kvforge.models.hub import resolve_model

COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json",
    "chat_template.jinja",
)


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    families: Mapping[str, Family] | None = None,
    revision: str | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """Export a local HF causal LM folder, or a GGUF file (converted first into `hf_dir`, default
    OUT_DIR.hf beside the output, and reused while the GGUF is unchanged). `options` (or the same
    fields as keywords: target, dtype, force, quantize, ...) say what to make; `quantize` ("int4" or
    "int8") quantises every weight matrix block-wise with ONNX Runtime's MatMulNBits quantiser (its
    accuracy cost is measured afterwards by `kvforge.tools.quant_accuracy.measure_quantized`, which `kvforge
    export` runs). `families`: the family registry (default: kvforge.models.families.families(); the
    coverage sweep passes its trials'). `model_dir` may be a Hugging Face Hub id (`org/name`, at `revision`): its
    snapshot in huggingface_hub's cache, downloaded only where HF_HUB_OFFLINE is unset (kvforge.models.hub); the
    manifest records the id and commit. Returns the manifest that was written to `out_dir`."""
    if options is not None and keywords:
        raise InputError("pass export options either as ExportOptions or as keywords, not both")
    try:
        options = options or ExportOptions(**keywords)
    except TypeError as err:
        raise InputError(f"export_model: {err}") from None
    model_dir = resolve_model(model_dir, revision, progress)  # a Hub id: its cached (or downloaded) snapshot
    layout = quantization.read_layout(model_dir)  # a pre-quantised checkpoint's: read once, here
    options = quantization.with_checkpoint_bits(options, layout, model_dir)
    target = options.resolve()
    check_model_path(model_dir)  # a typo, a file or a Hub id: said at once, before torch loads
    from kvforge.exporter.encoder_decoder import export_encoder_decoder, peek_family

    seq2seq = peek_family(model_dir)  # an encoder-decoder: its own three graphs (exporter/encoder_decoder.py)
    if seq2seq is not None:
        return export_encoder_decoder(Path(model_dir).resolve(), Path(out_dir).absolute(), options, target, seq2seq,
                                      progress or (lambda _msg: None))
    _refuse_images(model_dir, options, target)  # from config.json alone, before anything loads
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir).absolute()
    with removed_on_failure(conversion_dir(options, out_dir)):
        manifest = _export(model_dir, out_dir, options, target, layout, say, families)
    # The manifest's figures, so that whoever reports them (the demo) says the same numbers.
    seconds = manifest["export_seconds"]
    before = f"; converting the GGUF before it took {seconds['gguf_convert']:.1f} s" if "gguf_convert" in seconds else ""
    say(f"exported to {out_dir}: load, trace, optimise and write took {seconds['total']:.1f} s{before}")
    return manifest


def _export(model_dir: str | Path, out_dir: Path, options: ExportOptions, target: ExportTarget, prequantized: Any,
            say: Callable[[str], None], families: Mapping[str, Family] | None) -> dict[str, Any]:
    """export_model's work once the options are checked: the manifest written with the export at `out_dir`.
    `prequantized`: a pre-quantised checkpoint's layout (quantization/plan.py read_layout), or None."""
    from kvforge.exporter.lowering import lower

    model_dir, gguf_record, converted_s = _gguf_input(model_dir, out_dir, options, say)
    int_source = None
    if prequantized is not None:  # traced from its dequantised twin, its integers carried over
        hf_dir = conversion_dir(options, out_dir)
        check_output(out_dir, [model_dir, hf_dir], force=options.force, marker=MANIFEST_NAME)
        model_dir, int_source = quantization.prequantized_twin(model_dir, prequantized, hf_dir, say)
    dtype = options.dtype
    # Before any work: never replace something that is not an export, or that holds the model.
    check_output(out_dir, [model_dir], force=options.force, marker=MANIFEST_NAME)
    config = load_hf_config(model_dir, families)
    family = text_family(config, families)  # a multimodal checkpoint's text model: its text type's family
    family.check(config)
    target.check_model(config, family, dtype)
    vision = _vision_family(config, options, target)

    import torch

    started = time.perf_counter()
    check_weight_files(model_dir)  # pickle-only folders said as such
    checkpoint = open_checkpoint(model_dir)  # shards checked before anything is written; opened once
    source = quantization.classify(checkpoint, int_source, gguf_record)
    plan = quantization.QuantPlan.resolve(options, source)  # the method's and the lm_head's defaults, with why
    from kvforge.exporter.mtp_head import speculation_head
    draft = speculation_head(options, config, checkpoint, family, target, vision, say)  # checked before writing
    layout = KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=family.kv_heads(config),
                      head_dim=family.head_dim(config), dtype=DTYPES[dtype],
                      max_capacity=max_context(config))
    # The staging folder comes first, so an unwritable output fails before the slow work.
    with (_removed_after(calibration_work := out_dir.parent / f".{out_dir.name}.calibration"),
          StagedFolder(out_dir, MANIFEST_NAME, sources=[model_dir], say=say, force=options.force) as staged):
        assert staged.path is not None
        require_free_space(out_dir.parent, _expected_bytes(checkpoint, options), "the export")
        clock: dict[str, float] = {}
        int_weights = quantization.integer_weights(plan, source, model_dir, options.calibration, calibration_work,
                                                   clock, say)
        work = ExportWork(config, family, target, options, getattr(torch, DTYPES[dtype]), model_dir, checkpoint, say,
                          plan=plan, int_weights=int_weights, gguf_record=gguf_record, vision=vision, draft=draft)
        if converted_s is not None:  # the demo reports it beside the export's own total
            clock["gguf_convert"] = converted_s
        try:
            made = make_graphs(work, layout, clock, lower, families)
            fault_point("export:graphs-built")
            manifest = _write(staged.path, work, made, clock, started)
            staged.publish()
        except KvforgeError:
            raise
        except Exception as err:
            raise _failure(err, out_dir, model_dir) from err
    return manifest


def conversion_dir(options: ExportOptions, out_dir: Path) -> Path:
    """Where a GGUF is converted, or a pre-quantised checkpoint dequantised: --hf-dir, default OUT_DIR.hf."""
    return Path(options.hf_dir).absolute() if options.hf_dir is not None else out_dir.parent / f"{out_dir.name}.hf"


@contextlib.contextmanager
def removed_on_failure(hf_dir: Path) -> Iterator[None]:
    """A conversion folder (a GGUF's, a pre-quantised checkpoint's dequantised twin) that a failed export made is
    removed with it, so a failure leaves nothing behind; one that was there before (an earlier export's) stays."""
    made_here = not hf_dir.exists()
    try:
        yield
    except BaseException:
        from kvforge.models.checkpoint_names import PREQUANTIZED_MARKER

        # Only a folder kvforge wrote (its marker), never whatever else appeared there meanwhile.
        if made_here and any((hf_dir / marker).is_file() for marker in (GGUF_MARKER, PREQUANTIZED_MARKER)):
            shutil.rmtree(hf_dir, ignore_errors=True)
        raise


def _vision_family(config: Any, options: ExportOptions, target: ExportTarget) -> Any:
    """The vision-language row (models/vision_families.py) of a checkpoint exported whole, or None (text only)."""
    from kvforge.exporter.text_model import text_of
    from kvforge.models.vision_families import vision_family

    source = text_of(config) or {}
    vision = None if options.text_only else vision_family(source.get("model_type"))
    if vision is None:
        return None
    if not target.images:
        raise _no_images(vision.model_type, target)
    return vision


def _refuse_images(model_dir: str | Path, options: ExportOptions, target: ExportTarget) -> None:
    """A vision-language checkpoint (exported whole) for a target that takes no images, refused from its
    config.json alone: before torch, transformers and the checkpoint load (_vision_family says it for the rest)."""
    from kvforge.models.vision_families import vision_family

    config = Path(model_dir) / "config.json"
    if options.text_only or target.images or not config.is_file():
        return
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # a config that does not read: said by its own load
    if isinstance(model_type, str) and vision_family(model_type) is not None:
        raise _no_images(model_type, target)


def _no_images(model_type: str, target: ExportTarget) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{model_type}: a vision-language model, and --target {target.name} takes no images yet (its attention "
        "plugin has no image path); export with --target ort or --target onnx, or with --text-only for its text "
        "model alone")


def _gguf_input(model_dir: str | Path, out_dir: Path, options: ExportOptions,
                say: Callable[[str], None]) -> tuple[Path, dict[str, Any] | None, float | None]:
    """The Hugging Face folder to export: `model_dir` itself, or a GGUF file's conversion (made, or reused
    while the GGUF is unchanged); with the GGUF's record and the conversion's seconds (None if reused)."""
    gguf_file = find_gguf(model_dir) if Path(model_dir).exists() else None
    if gguf_file is None:
        return Path(model_dir).resolve(), None, None
    hf_dir = conversion_dir(options, out_dir)
    check_output(out_dir, [gguf_file.resolve(), hf_dir], force=options.force, marker=MANIFEST_NAME)
    converting, converted = time.perf_counter(), []

    def watch(message: str) -> None:  # a reused conversion is not reported as one
        converted.append(message.startswith("converting "))
        say(message)

    folder = convert_gguf(gguf_file, hf_dir, progress=watch)
    converted_s = time.perf_counter() - converting if any(converted) else None
    return Path(folder).resolve(), json.loads((Path(folder) / GGUF_MARKER).read_text()), converted_s


@contextlib.contextmanager
def _removed_after(folder: Path) -> Iterator[None]:
    """A work folder (AutoRound's output, read while the weights are written) gone when the export ends."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# A model without a position limit (state-space models, ALiBi) is exported for this many positions.
DEFAULT_CONTEXT = 4096


def max_context(config: Any) -> int:
    """The positions an export allows: the config's limit under one of its names, or DEFAULT_CONTEXT."""
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"):
        value = config_value(config, name)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def _write(staging: Path, work: ExportWork, made: MadeGraphs, clock: dict[str, float], started: float) -> dict[str, Any]:
    """The graphs with their one weights file, the model's tokenizer and config files, and the manifest."""
    graphs, config, model_dir, say, layout = made.graphs, work.config, work.model_dir, work.say, made.layout
    say(f"writing graphs and the shared weights file {WEIGHTS_NAME}")
    writing = time.perf_counter()
    sizes = save_with_shared_weights(graphs, staging, WEIGHTS_NAME, _write_progress(say))
    clock["write"] = time.perf_counter() - writing
    fault_point("export:weights-written")
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, staging / name)
    if not (staging / "tokenizer.json").is_file():
        say("warning: no tokenizer.json in the model folder; generate will take token ids only")
    extra: dict[str, Any] = {}
    if made.quantization is not None:
        extra["quantization"] = {**made.quantization, "weights_bytes": sizes["weights_bytes"]}
    if made.kv_quant is not None:  # the cache the runtime allocates is int8; how its scales were made
        extra["kv_cache_quantization"] = made.kv_quant
        layout = dataclasses.replace(layout, dtype=KV_CACHE_DTYPES[made.kv_quant["dtype"]])
    clock["total"] = time.perf_counter() - started
    extra["export_seconds"] = {name: round(value, 2) for name, value in clock.items()}
    if made.vision is not None:
        extra["vision"] = made.vision
    if made.draft is not None:
        extra["draft"] = made.draft
    manifest = export_manifest(config, model_dir, work.target.core, work.options.dtype, layout, graphs, staging, sizes,
                               work.gguf_record, extra)
    for field, ids in manifest["model"].get("dropped_token_ids", {}).items():
        say(f"note: {field} {ids} left out: at or beyond the vocabulary ({config.vocab_size} tokens), the model "
            "cannot emit it")
    write_manifest(staging, manifest)
    fault_point("export:manifest-written")
    return manifest


def _write_progress(say: Callable[[str], None]) -> Callable[[int, int], None]:
    """A line per tenth of the weights file, so a long write shows it is moving."""
    shown = [0]

    def progress(written: int, in_all: int) -> None:
        tenth = written * 10 // max(in_all, 1)
        if tenth > shown[0] and in_all > 1 << 30:
            shown[0] = tenth
            say(f"weights: {written / 1e9:.2f} of {in_all / 1e9:.2f} GB written")
    return progress


def _expected_bytes(checkpoint: Any, options: ExportOptions) -> int:
    """About what the weights file takes: the checkpoint's bytes at the export's bits per weight."""
    source_bytes = {"float32": 4, "float64": 8}.get(checkpoint.dtype or "", 2)
    if options.quantize is not None:
        bits = 4.5 if options.quantize == "int4" else 8.5  # with the blocks' scales
        return int(checkpoint.nbytes / source_bytes * bits / 8)
    return int(checkpoint.nbytes / source_bytes * {"fp32": 4}.get(options.dtype, 2))


def _failure(err: Exception, out_dir: Path, model_dir: Path) -> ExportError:
    """An export's unexpected failure as one ExportError naming its cause (nothing changed at the output)."""
    if disk_full(err, out_dir.parent):
        # Whatever layer failed (onnx-ir, numpy's tofile, shutil's copy naming the *source*
        # file), the cause is the output's filesystem: name the output, not the model.
        return disk_full_error(out_dir)
    if isinstance(err, OSError):
        return ExportError(f"export of {model_dir} failed writing {err.filename or out_dir}: {err.strerror or err}; "
                           "nothing was changed at the output")
    if "longrope_frequency_update" in str(err):
        # transformers 5.17's LongRoPE asks for the sequence length as a Python value, which
        # torch.export cannot give; the transformers CI installs (5.24) traces it.
        import transformers

        return ExportError(
            f"transformers {transformers.__version__} cannot trace {model_dir}'s LongRoPE for export "
            "(a data-dependent branch in longrope_frequency_update); upgrade transformers (5.24 works: "
            "pip install -U transformers); nothing was changed at the output")
    return ExportError(f"export of {model_dir} failed: {type(err).__name__}: {one_line(err)}")


