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
from dataclasses import dataclass
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
from kvforge.exporter.quantize import check_options as check_quantize
from kvforge.exporter.targets import ExportTarget, export_target
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


@dataclass(frozen=True)
class ExportOptions:
    """What `kvforge export` makes of a model (checked by `resolve()` before any work)."""

    target: str = "ort"
    dtype: str = "fp32"
    quantize: str | None = None  # "int4" | "int8": MatMulNBits weights (targets with `quantize`)
    block_size: int = 32
    accuracy_level: int = 4
    lm_head_bits: int | None = None  # 8: an 8-bit lm_head with int4
    # "rtn" | "hqq" | "autoround": how int4 values are chosen (exporter/quantize.py METHODS); None: the default
    # (exporter/quantize.py default_method: hqq for int4 under 1B parameters in fp32, else autoround or rtn)
    quant_method: str | None = None
    calibration: str | Path | None = None  # autoround's calibration text (default: kvforge's own)
    kv_cache: str | None = None  # "int8": a quantised KV cache (targets with `kv_cache_dtypes`; exporter/kv_quant.py)
    force: bool = False  # replace an existing export at the output
    hf_dir: str | Path | None = None  # where a GGUF input is converted (default OUT_DIR.hf)
    # gate/up MatMuls merged into one: None = where it pays (int4/int8, ort fp16/bf16: optimize.fuse_graph);
    # the Python API's switch for benchmarks that compare the two graphs
    merge_pairs: bool | None = None
    # Stream the weights from the checkpoint's shards into the weights file (exporter/lazy_weights.py) where
    # the model allows it; False: load the whole model first, as exports did before streaming
    stream: bool = True
    # Streamed, trace two of a model's alike layers and stamp the rest (exporter/layer_stamping.py); False:
    # trace every layer (the Python API's switch, for tests that compare the two)
    stamp: bool = True
    # A vision-language checkpoint (models/vision_families.py) is exported whole, vision.onnx included; True: its
    # text model alone, as exports did before vision.onnx
    text_only: bool = False
    # A checkpoint's multi-token-prediction layer exported as the speculation head draft.onnx (exporter/mtp_head.py)
    # where it ships one; False (--no-mtp): the target alone
    mtp: bool = True
    eagle: str | Path | None = None  # an EAGLE-3 head's folder, exported as draft.onnx (exporter/draft_head.py)
    draft_lm_head_bits: int | None = None  # 8 or 4: draft.onnx's lm_head as MatMulNBits (exporter/draft_quant.py)

    def resolve(self) -> ExportTarget:
        """The target, resolved once, after checking every option against it."""
        target = export_target(self.target)
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_quantize(self.quantize, self.block_size, self.dtype, self.lm_head_bits, self.quant_method,
                       self.accuracy_level)
        if self.calibration is not None and self.quant_method not in (None, "autoround"):
            raise InputError(f"--calibration goes with --quant-method autoround, not {self.quant_method}")
        if self.quant_method == "autoround" or self.calibration is not None:
            from kvforge.exporter.calibrate import read_calibration

            read_calibration(self.calibration)  # an empty or binary file is said before any work
        target.check_options(self)
        return target


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
    options = _checkpoint_bits(options, model_dir)
    target = options.resolve()
    check_model_path(model_dir)  # a typo, a file or a Hub id: said at once, before torch loads
    _refuse_images(model_dir, options, target)  # from config.json alone, before anything loads
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir).absolute()
    with removed_on_failure(conversion_dir(options, out_dir)):
        manifest = _export(model_dir, out_dir, options, target, say, families)
    # The manifest's figures, so that whoever reports them (the demo) says the same numbers.
    seconds = manifest["export_seconds"]
    before = f"; converting the GGUF before it took {seconds['gguf_convert']:.1f} s" if "gguf_convert" in seconds else ""
    say(f"exported to {out_dir}: load, trace, optimise and write took {seconds['total']:.1f} s{before}")
    return manifest


def _export(model_dir: str | Path, out_dir: Path, options: ExportOptions, target: ExportTarget,
            say: Callable[[str], None], families: Mapping[str, Family] | None) -> dict[str, Any]:
    """export_model's work once the options are checked: the manifest written with the export at `out_dir`."""
    from kvforge.exporter.lowering import lower

    model_dir, gguf_record, converted_s = _gguf_input(model_dir, out_dir, options, say)
    options, method_default = _default_method(options, model_dir, gguf_record)
    model_dir, int_weights = _integer_weights(options, model_dir, out_dir, gguf_record, say)
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
    checkpoint = open_checkpoint(model_dir)  # shards checked before anything is written
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
        int_weights = int_weights or _calibrated(options, model_dir, calibration_work, clock, say)
        work = ExportWork(config, family, target, options, getattr(torch, DTYPES[dtype]), model_dir, checkpoint, say,
                          int_weights, method_default, gguf_record, vision, draft)
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
        from kvforge.models.prequantized import MARKER as PREQUANTIZED_MARKER

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


def _default_method(options: ExportOptions, model_dir: Path,
                    gguf_record: dict[str, Any] | None) -> tuple[ExportOptions, str | None]:
    """The options with --quant-method's default chosen for this model, and why (None: it was given)."""
    from kvforge.exporter.quantize import default_method

    if options.quant_method is not None:
        return options, None
    if options.calibration is not None:  # a calibration text asks for calibration
        return dataclasses.replace(options, quant_method="autoround"), None
    parameters = 0
    if options.quantize is not None and (Path(model_dir) / "config.json").is_file():
        checkpoint = open_checkpoint(model_dir)
        parameters = checkpoint.nbytes // {"float32": 4, "float64": 8}.get(checkpoint.dtype or "", 2)
    method, why = default_method(options.quantize, parameters, gguf_record is not None, options.dtype)
    return dataclasses.replace(options, quant_method=method), why


def _calibrated(options: ExportOptions, model_dir: Path, work: Path, clock: dict[str, float],
                say: Callable[[str], None]) -> Any:
    """AutoRound's integer weights (--quant-method autoround), or None."""
    if options.quant_method != "autoround":
        return None
    from kvforge.exporter.calibrate import calibrate

    began = time.perf_counter()
    source = calibrate(model_dir, 4, options.block_size, options.calibration, work, say)
    clock["calibrate"] = time.perf_counter() - began
    return source


@contextlib.contextmanager
def _removed_after(folder: Path) -> Iterator[None]:
    """A work folder (AutoRound's output, read while the weights are written) gone when the export ends."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _checkpoint_bits(options: ExportOptions, model_dir: str | Path) -> ExportOptions:
    """A pre-quantised checkpoint's integers are carried over as they are: --quantize takes its bits (given or
    not); another width or method is refused. A format kvforge does not take is refused here, in one line."""
    from kvforge.models.prequantized_convert import prequantized_layout

    if not (Path(model_dir) / "config.json").is_file():
        return options
    layout = prequantized_layout(Path(model_dir))
    if layout is None:
        return options
    bits = f"int{layout.bits}"
    if options.quantize not in (None, bits) or options.quant_method not in (None, "rtn"):
        asked = f"--quantize {options.quantize}" if options.quantize not in (None, bits) else \
            f"--quant-method {options.quant_method}"
        raise InputError(f"{model_dir} is {layout.article} {layout.describe()} checkpoint: kvforge carries its integers over as they "
                         f"are, so {asked} does not apply; drop it")
    return dataclasses.replace(options, quantize=bits, quant_method="rtn")  # its integers: nothing to calibrate


def _integer_weights(options: ExportOptions, model_dir: Path, out_dir: Path, gguf_record: dict[str, Any] | None,
                     say: Callable[[str], None]) -> tuple[Path, Any]:
    """Where weights already held as integers come from: a pre-quantised checkpoint (traced from its
    dequantised twin, its integers carried over) or, with --quantize, a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks. Returns the
    folder to trace and the integer-weight source (None: every weight is rounded)."""
    from kvforge.models.prequantized_convert import convert_prequantized, prequantized_layout

    if gguf_record is not None:
        if options.quantize is None or options.quant_method != "rtn":
            return model_dir, None
        from kvforge.models.gguf_blocks import gguf_int_weights

        return model_dir, gguf_int_weights(gguf_record["source"], model_dir)
    layout = prequantized_layout(model_dir)
    if layout is None:
        return model_dir, None
    hf_dir = conversion_dir(options, out_dir)
    check_output(out_dir, [model_dir, hf_dir], force=options.force, marker=MANIFEST_NAME)
    from kvforge.models.checkpoint_names import refuse_doubled_layers
    from kvforge.models.prequantized import PrequantizedWeights

    weights = PrequantizedWeights(model_dir, layout)
    refuse_doubled_layers(model_dir, weights.prefixes, weights.files)  # before its twin is written
    folder = convert_prequantized(model_dir, hf_dir, say)
    return Path(folder).resolve(), weights


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


