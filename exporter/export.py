"""`kvforge export`: local HF folder -> prefill.onnx + decode.onnx (+ shared weights) + manifest.

HF model (exporter/load.py) --(one dynamo trace, attention routed through the kvforge op;
exporter/trace.py)--> canonical prefill graph --(clean-up and fusions; exporter/optimize.py)-->
--(decode derived; exporter/trace.py)--> lowering per target (exporter/lowering.py) --> saved
graphs and manifest (kvforge/core/manifest.py). Everything is written to a temporary sibling folder
and renamed into place at the end, so a failed export leaves nothing that looks valid.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.core.contract import DTYPES, KV_CACHE_DTYPES, KVLayout, StateSpec
from kvforge.core.errors import ExportError, InputError, KvforgeError, UnsupportedModelError
from kvforge.core.manifest import MANIFEST_NAME, write_manifest
from kvforge.core.output_folder import StagedFolder, check_output, disk_full, disk_full_error, fault_point
from kvforge.core.targets import Target, get_target
from kvforge.exporter.export_manifest import WEIGHTS_NAME, export_manifest
from kvforge.exporter.load import check_model_path, load_hf_config, load_hf_model, one_line
from kvforge.exporter.probe import layer_shapes, probe_states
from kvforge.exporter.quantize import check_options as check_quantize
from kvforge.exporter.targets import EXPORT_TARGETS, export_target
from kvforge.exporter.text_model import text_family
from kvforge.exporter.weights import save_with_shared_weights
from kvforge.models.adapters import adapt_for_export
from kvforge.models.config_values import config_value
from kvforge.models.families import Family
from kvforge.models.gguf import GGUF_MARKER, convert_gguf, find_gguf

TRT_HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two the Triton kernel compiles for
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
    quant_method: str = "rtn"  # "rtn" | "hqq": how int4 values are chosen (exporter/quantize.py METHODS)
    kv_cache: str | None = None  # "int8": a quantised KV cache (targets with `kv_cache_dtypes`; exporter/kv_quant.py)
    force: bool = False  # replace an existing export at the output
    hf_dir: str | Path | None = None  # where a GGUF input is converted (default OUT_DIR.hf)
    # gate/up MatMuls merged into one: None = where it pays (int4/int8, ort fp16/bf16: optimize.fuse_graph);
    # the Python API's switch for benchmarks that compare the two graphs
    merge_pairs: bool | None = None

    def resolve(self) -> Target:
        """The target's registry entry, after checking every option against it."""
        target = get_target(self.target)
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_quantize(self.quantize, self.block_size, self.dtype, self.lm_head_bits, self.quant_method,
                       self.accuracy_level)
        passes = export_target(target.name)
        if self.quantize is not None and not passes.quantize:
            raise InputError(f"--quantize produces ONNX Runtime's MatMulNBits: use it with --target ort, not {target.name}")
        if self.kv_cache is not None:
            if self.kv_cache not in KV_CACHE_DTYPES:
                raise InputError(f"--kv-cache takes {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache!r}")
            if self.kv_cache not in passes.kv_cache_dtypes:
                able = [t.name for t in EXPORT_TARGETS.values() if self.kv_cache in t.kv_cache_dtypes]
                raise InputError(
                    f"--kv-cache {self.kv_cache}: the {target.name} target's attention ({target.summary}) has no "
                    f"quantised cache; use --target {' or '.join(able)}"
                )
            if self.dtype != "fp32":
                raise InputError(f"--kv-cache {self.kv_cache} is measured with fp32 activations only; drop --dtype {self.dtype}")
        return target


def _check_kernel_shapes(config, family: Family, head_dim: int, target: Target, dtype: str,
                         kv_heads: int | None = None) -> None:
    """The `trt` target runs kvforge's own kernel: refuse at export what it cannot compute."""
    from kvforge.plugins import attention_launch

    others = " or ".join(f"--target {name}" for name, t in EXPORT_TARGETS.items() if not t.kernel_shapes)
    kv_heads = kv_heads or family.kv_heads(config)
    heads = config_value(config, "num_attention_heads")
    if heads is None:  # no attention (a state-space model): nothing for the kernel; its states are refused later
        return
    try:
        attention_launch.check_shapes(heads, kv_heads, head_dim)
    except ValueError as err:
        raise UnsupportedModelError(
            f"--target {target.name} cannot export {config.model_type} ({err}): kvforge's attention kernel supports "
            f"head_dim {', '.join(map(str, TRT_HEAD_DIMS))}, query heads a multiple of the KV heads, and "
            f"dtype {', '.join(target.dtypes)}; use {others} for this model"
        ) from err
    if dtype not in target.dtypes:
        raise UnsupportedModelError(f"--target {target.name} supports dtype {', '.join(target.dtypes)}, not {dtype!r}")


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    families: Mapping[str, Family] | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """Export a local HF causal LM folder, or a GGUF file (converted first into `hf_dir`, default
    OUT_DIR.hf beside the output, and reused while the GGUF is unchanged). `options` (or the same
    fields as keywords: target, dtype, force, quantize, ...) say what to make; `quantize` ("int4" or
    "int8") quantises every weight matrix block-wise with ONNX Runtime's MatMulNBits quantiser (its
    accuracy cost is measured afterwards by `kvforge.tools.parity.measure_quantized`, which `kvforge
    export` runs). `families`: the family registry (default: kvforge.models.families.families(); the
    coverage sweep passes its trials'). Returns the manifest that was written to `out_dir`."""
    if options is not None and keywords:
        raise InputError("pass export options either as ExportOptions or as keywords, not both")
    try:
        options = options or ExportOptions(**keywords)
    except TypeError as err:
        raise InputError(f"export_model: {err}") from None
    target = options.resolve()
    check_model_path(model_dir)  # a typo, a file or a Hub id: said at once, before torch loads
    from kvforge.exporter.lowering import lower

    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir).absolute()
    model_dir, gguf_record, converted_s = _gguf_input(model_dir, out_dir, options, say)
    dtype = options.dtype
    # Before any work: never replace something that is not an export, or that holds the model.
    check_output(out_dir, [model_dir], force=options.force, marker=MANIFEST_NAME)
    config = load_hf_config(model_dir, families)
    family = text_family(config, families)  # a multimodal checkpoint's text model: its text type's family
    family.check(config)
    passes = export_target(target.name)
    if passes.kernel_shapes and family.trt_refusal:
        raise UnsupportedModelError(f"--target {target.name} cannot export {config.model_type} (the coverage sweep: "
                                    f"{family.trt_refusal}); use --target ort or --target onnx")
    if passes.kernel_shapes:
        _check_kernel_shapes(config, family, family.head_dim(config), target, dtype)

    import torch

    started = time.perf_counter()
    layout = KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=family.kv_heads(config),
                      head_dim=family.head_dim(config), dtype=DTYPES[dtype],
                      max_capacity=max_context(config))
    # The staging folder comes first, so an unwritable output fails before the slow work.
    with StagedFolder(out_dir, MANIFEST_NAME, sources=[model_dir], say=say) as staged:
        assert staged.path is not None
        say(f"loading {model_dir.name} ({', '.join(config.architectures or [config.model_type])}, {dtype})")
        model = load_hf_model(model_dir, dtype, families)
        layout = adapt_for_export(model, layout, say)  # families kvforge reaches through an adapter
        layout = _probe_model(model, config, family, layout, target, dtype, say)
        fault_point("export:model-loaded")
        # Where the export's time goes (manifest "export_seconds"): the profile `kvforge bench` reports.
        clock = {"load": time.perf_counter() - started}
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            clock[name] = clock.get(name, 0.0) + now - mark
            mark = now

        if converted_s is not None:  # the demo reports it beside the export's own total
            clock["gguf_convert"] = converted_s
        try:
            graphs, quantization, kv_quant = _build_graphs(model, config, family, layout, target, options,
                                                           getattr(torch, DTYPES[dtype]), say, lap, lower, model_dir)
            fault_point("export:graphs-built")
            manifest = _write(staged.path, graphs, config, model_dir, target, dtype, layout, gguf_record,
                              quantization, kv_quant, clock, started, lap, say)
            staged.publish()
        except KvforgeError:
            raise
        except Exception as err:
            raise _failure(err, out_dir, model_dir) from err
    # The manifest's figures, so that whoever reports them (the demo) says the same numbers.
    seconds = manifest["export_seconds"]
    before = f"; converting the GGUF before it took {seconds['gguf_convert']:.1f} s" if "gguf_convert" in seconds else ""
    say(f"exported to {out_dir}: load, trace, optimise and write took {seconds['total']:.1f} s{before}")
    return manifest


def _gguf_input(model_dir: str | Path, out_dir: Path, options: ExportOptions,
                say: Callable[[str], None]) -> tuple[Path, dict[str, Any] | None, float | None]:
    """The Hugging Face folder to export: `model_dir` itself, or a GGUF file's conversion (made, or reused
    while the GGUF is unchanged); with the GGUF's record and the conversion's seconds (None if reused)."""
    gguf_file = find_gguf(model_dir) if Path(model_dir).exists() else None
    if gguf_file is None:
        return Path(model_dir).resolve(), None, None
    hf_dir = Path(options.hf_dir) if options.hf_dir is not None else out_dir.parent / f"{out_dir.name}.hf"
    check_output(out_dir, [gguf_file.resolve(), hf_dir.absolute()], force=options.force, marker=MANIFEST_NAME)
    converting, converted = time.perf_counter(), []

    def watch(message: str) -> None:  # a reused conversion is not reported as one
        converted.append(message.startswith("converting "))
        say(message)

    folder = convert_gguf(gguf_file, hf_dir, progress=watch)
    converted_s = time.perf_counter() - converting if any(converted) else None
    return Path(folder).resolve(), json.loads((Path(folder) / GGUF_MARKER).read_text()), converted_s


def _probe_model(model: Any, config: Any, family: Family, layout: KVLayout, target: Target, dtype: str,
                 say: Callable[[str], None]) -> KVLayout:
    """Prepare the loaded model's experts for export and check the attention shapes HF really passes
    against the target; the KV layout those shapes give."""
    passes = export_target(target.name)
    # Mixture-of-experts layers: SwiGLU-gated experts become the canonical MoE node (exporter/moe.py;
    # ONNX Runtime's MoE on `ort`, the picked experts gathered on the others); any other gate keeps
    # transformers' "batched_mm" gather form. Its default implementations have no ONNX form.
    from kvforge.exporter.moe import prepare_looped_experts

    looped = prepare_looped_experts(model)  # experts written as a loop over the picked ones (DBRX, LongCat)
    if looped:
        say(f"experts: {looped} looped MoE layers as the canonical MoE node")
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        from kvforge.exporter.moe import prepare_experts

        model.set_experts_implementation("batched_mm")
        routed = prepare_experts(model)
        say(f"experts: {routed['node']} MoE layers as the canonical MoE node"
            + (f", {routed['batched_mm']} in transformers' batched_mm form" if routed["batched_mm"] else ""))
    # Recurrent / linear-attention layers whose state lives in transformers' cache keep it as state buffers.
    found = probe_states(model)
    states = tuple(StateSpec(layer, kind, shape, _dtype_name(torch_dtype))
                   for layer, kinds in sorted(found.items()) for kind, (shape, torch_dtype) in sorted(kinds.items()))
    if states and passes.kernel_shapes:
        stateful = sorted({spec.layer for spec in states})
        raise UnsupportedModelError(f"{config.model_type}: its layers {stateful[:8]} keep a recurrent state, which "
                                    f"--target {target.name}'s TensorRT engines do not carry yet; use --target ort or "
                                    "--target onnx")
    if states:
        say(f"recurrent state: {len({spec.layer for spec in states})} layers keep {len(states)} state buffers "
            f"({', '.join(sorted({spec.kind for spec in states}))})")
    # The head counts HF's attention really receives (a config's own convention can differ:
    # multi_query, num_kv_heads, ...), per layer: the KV cache follows them.
    shapes = layer_shapes(model, layout.num_layers, frozenset(found))
    for head_dim in sorted({shape.cache_dim for shape in shapes if shape is not None}):
        if head_dim % passes.head_dim_multiple:
            others = " or ".join(f"--target {name}" for name, t in EXPORT_TARGETS.items()
                                 if head_dim % t.head_dim_multiple == 0 and not t.kernel_shapes)
            raise UnsupportedModelError(f"{config.model_type}: its head size {head_dim} is not a multiple of "
                                        f"{passes.head_dim_multiple}, which --target {target.name}'s attention "
                                        f"({target.summary.split(' (')[0]}) needs; use {others}")
    if passes.kernel_shapes and any(shape.sinks for shape in shapes if shape is not None):
        # Worded as a reason (the sweep records it as the type's `trt` refusal, which the check before
        # loading raises; this one catches a model outside the registry's rows).
        raise UnsupportedModelError(f"{config.model_type}: its attention has sinks, which kvforge's TensorRT "
                                    f"kernel (--target {target.name}) does not implement")
    probed = KVLayout.per_layer([None if shape is None else (shape.kv_heads, shape.cache_dim) for shape in shapes],
                                layout.dtype, layout.max_capacity, states)
    if probed != layout:
        layout = probed
        if passes.kernel_shapes:
            for heads, head_dim in sorted(set(layout.layer_shapes())):
                _check_kernel_shapes(config, family, head_dim, target, dtype, kv_heads=heads)
    return layout


# A model without a position limit (state-space models, ALiBi) is exported for this many positions.
DEFAULT_CONTEXT = 4096


def max_context(config: Any) -> int:
    """The positions an export allows: the config's limit under one of its names, or DEFAULT_CONTEXT."""
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"):
        value = config_value(config, name)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def _dtype_name(torch_dtype: Any) -> str:
    """float32 / float16 / bfloat16: a torch dtype's name, as the contract spells cache dtypes."""
    return str(torch_dtype).removeprefix("torch.")


def _write(staging: Path, graphs: dict[str, Any], config: Any, model_dir: Path, target: Target, dtype: str,
           layout: KVLayout, gguf_record: dict[str, Any] | None, quantization: dict[str, Any] | None,
           kv_quant: dict[str, Any] | None, clock: dict[str, float], started: float, lap: Callable[[str], None],
           say: Callable[[str], None]) -> dict[str, Any]:
    """The graphs with their one weights file, the model's tokenizer and config files, and the manifest."""
    say(f"writing graphs and the shared weights file {WEIGHTS_NAME}")
    sizes = save_with_shared_weights(graphs, staging, WEIGHTS_NAME)
    lap("write")
    fault_point("export:weights-written")
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, staging / name)
    if not (staging / "tokenizer.json").is_file():
        say("warning: no tokenizer.json in the model folder; generate will take token ids only")
    extra: dict[str, Any] = {}
    if quantization is not None:
        extra["quantization"] = {**quantization, "weights_bytes": sizes["weights_bytes"]}
    if kv_quant is not None:  # the cache the runtime allocates is int8; how its scales were made
        extra["kv_cache_quantization"] = kv_quant
        layout = dataclasses.replace(layout, dtype=KV_CACHE_DTYPES[kv_quant["dtype"]])
    clock["total"] = time.perf_counter() - started
    extra["export_seconds"] = {name: round(value, 2) for name, value in clock.items()}
    manifest = export_manifest(config, model_dir, target, dtype, layout, graphs, staging, sizes, gguf_record, extra)
    write_manifest(staging, manifest)
    fault_point("export:manifest-written")
    return manifest


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


def _build_graphs(model, config, family: Family, layout: KVLayout, target: Target, options: ExportOptions,
                  torch_dtype, say, lap, lower, model_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Trace, clean up, fuse, (quantise,) derive decode and lower: the two graphs in memory, the weight
    quantisation's record and the quantised KV cache's (None when not asked for)."""
    from kvforge.exporter.fusions import rotary_caches
    from kvforge.exporter.optimize import fuse_graph, optimize_graph
    from kvforge.exporter.quantize import quantize_model
    from kvforge.exporter.trace import derive_decode_graph, trace_prefill

    say("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it")
    prefill = trace_prefill(model, layout, torch_dtype, family)
    lap("trace")
    optimize_graph(prefill)
    lap("optimize")
    fused = fuse_graph(prefill, target, quantized=options.quantize is not None, dtype=options.dtype,
                       merge_pairs=options.merge_pairs)
    lap("fuse")
    say("fused " + ", ".join(f"{count} {name}" for name, count in fused.items() if count))
    quantization = None
    if options.quantize is not None:
        from kvforge.exporter.quantize import default_lm_head_bits

        parameters = sum(p.numel() for p in model.parameters())
        lm_head_bits, why = options.lm_head_bits, None
        if lm_head_bits is None:
            lm_head_bits, why = default_lm_head_bits(options.quantize, parameters)
        say(f"quantising the weights to {options.quantize} (blocks of {options.block_size}, "
            f"{options.quant_method.upper()}, ONNX Runtime's MatMulNBits)" + (f"; {why}" if why else ""))
        prefill, quantization = quantize_model(prefill, options.quantize, options.block_size, int(config.vocab_size),
                                               options.accuracy_level, lm_head_bits, options.quant_method)
        if why:
            quantization["lm_head_bits_default"] = why
        lap("quantize")
    kv_scales, kv_quant = None, None
    if options.kv_cache is not None:
        from kvforge.exporter.kv_quant import calibrate

        say(f"calibrating {options.kv_cache} KV cache scales on kvforge's shipped text (per kv head and channel)")
        kv_scales, kv_quant = calibrate(model, config, layout, model_dir, options.kv_cache)
        lap("kv_calibrate")
    # After quantisation, not in fuse_graph: the quantiser shares a tied embedding with its lm_head itself.
    if export_target(target.name).ort_fusions and options.quantize is None:
        from kvforge.exporter.fusions import pretranspose_tied_lm_head

        pretranspose_tied_lm_head(prefill)
    graphs = {"prefill": prefill, "decode": derive_decode_graph(prefill)}
    # The experts' weights are quantised by the MoE lowering (ONNX Runtime's QMoE takes its own layout).
    moe_quantize = None
    if options.quantize is not None:
        from kvforge.exporter.moe import INT8_EXPERTS, moe_nodes
        from kvforge.exporter.quantize import BITS

        experts = len(moe_nodes(prefill.graph))
        if experts and BITS[options.quantize] == 4:
            moe_quantize = (4, options.block_size)
            quantization["moe_experts"] = f"int4, blocks of {options.block_size} (ONNX Runtime's QMoE), {experts} layers"
            say(f"quantising {experts} MoE layers' experts to int4 (ONNX Runtime's QMoE)")
        elif experts:
            quantization["moe_experts"] = INT8_EXPERTS
            say(f"note: {INT8_EXPERTS}")
    rotary = rotary_caches(model, layout.max_capacity, layout.dtype) \
        if export_target(target.name).ort_fusions else None
    for phase, graph in graphs.items():
        say(f"lowering {phase} attention for target {target.name}")
        lower(graph, target.name, rotary, kv_scales, moe_quantize, attends=bool(layout.layer_shapes()))
        graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    lap("derive_and_lower")
    return graphs, quantization, kv_quant
