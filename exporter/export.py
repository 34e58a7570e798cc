"""`kvforge export`: local HF folder -> prefill.onnx + decode.onnx (+ shared weights) + manifest.

HF model --(wrapper: attention routed through the kvforge op)--> canonical graphs (torch.onnx,
dynamo) --(lowering per target)--> saved graphs. Everything is written to a temporary sibling
folder and renamed into place at the end, so a failed export leaves nothing that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvforge import __version__
from kvforge.errors import ExportError, InputError, KvforgeError, UnsupportedModelError
from kvforge.exporter.fusions import rotary_caches
from kvforge.exporter.quantize import check_options as check_quantize
from kvforge.exporter.quantize import quantize_model
from kvforge.exporter.weights import save_with_shared_weights
from kvforge.manifest import FORMAT, MANIFEST_NAME, file_record, write_manifest
from kvforge.models.families import family_for
from kvforge.models.gguf import GGUF_MARKER, convert_gguf, find_gguf
from kvforge.output_folder import StagedFolder, check_output, fault_point

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
TRT_HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two the Triton kernel compiles for
WEIGHTS_NAME = "model.weights"
OPSET = 24
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json",
    "chat_template.jinja",
)
# Example sizes for tracing; every one of these dimensions is dynamic in the graphs.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_CAPACITY = 2, 8, 32


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def load_hf_config(model_dir: str | Path):
    """AutoConfig for a local HF folder, with errors that say what is wrong. The family is checked
    on the raw config.json first, so an unknown model_type is named as such."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"{model_dir} is not a folder; pass a local Hugging Face model folder")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{config_file} is not valid JSON ({_one_line(err)}); fix or re-save the model folder") from err
    if not isinstance(raw, dict):
        raise InputError(f"{config_file} holds a JSON {type(raw).__name__}, not an object: not a model config")
    family_for(SimpleNamespace(model_type=raw.get("model_type"), architectures=raw.get("architectures")))
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise InputError(f"{config_file} could not be read by transformers: {_one_line(err)}") from err


def _check_weight_files(model_dir: Path) -> None:
    """kvforge reads safetensors only: pickle checkpoints can run code when loaded."""
    if any(model_dir.glob("*.safetensors")) or (model_dir / "model.safetensors.index.json").is_file():
        return
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InputError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}); kvforge loads safetensors only, "
            "because unpickling can run code: convert them (e.g. load in transformers and save_pretrained "
            "with safe_serialization=True) and export again"
        )
    raise InputError(f"{model_dir} has no weights (*.safetensors); pass a complete Hugging Face model folder")


def load_hf_model(model_dir: str | Path, dtype: str = "fp32"):
    """The local HF model with its eager attention, in eval mode (also the parity reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # kvforge prints its own progress; keep stderr readable
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    family_for(config)
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_weight_files(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="eager", local_files_only=True,
            use_safetensors=True, trust_remote_code=False,
        )
    except Exception as err:  # safetensors, transformers and torch each raise their own types
        raise InputError(
            f"could not load the weights of {model_dir}: {type(err).__name__}: {_one_line(err)}; "
            "the files may be truncated or corrupted"
        ) from err
    return model.eval()


def _check_trt_kernel(config, head_dim: int, dtype: str) -> None:
    """The `trt` target runs kvforge's own kernel: refuse at export what it cannot compute."""
    from kvforge.plugins import attention_launch

    try:
        attention_launch.check_shapes(config.num_attention_heads, family_for(config).kv_heads(config), head_dim)
    except ValueError as err:
        raise UnsupportedModelError(
            f"--target trt cannot export {config.model_type} ({err}): kvforge's attention kernel supports "
            f"head_dim {', '.join(map(str, TRT_HEAD_DIMS))}, query heads a multiple of the KV heads, and "
            f"dtype {', '.join(DTYPES)}; use --target ort or --target onnx for this model"
        ) from err
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"--target trt supports dtype {', '.join(DTYPES)}, not {dtype!r}")


def graph_io_names(num_layers: int, phase: str) -> tuple[list[str], list[str]]:
    cache_in = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    cache_out = [f"present_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "past_lens"] + (["logits_index"] if phase == "prefill" else []) + cache_in
    return inputs, ["logits"] + cache_out


def _export_phase(model, phase: str, num_layers: int, kv_heads: int, head_dim: int, torch_dtype):
    import torch
    from torch.export import Dim

    from kvforge.exporter.wrapper import GraphWrapper
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    batch_dim, seq_dim, capacity_dim, k_dim = Dim("batch"), Dim("seq"), Dim("capacity"), Dim("positions")
    seq = _EXAMPLE_SEQ if phase == "prefill" else 1
    b = _EXAMPLE_BATCH
    cache = [torch.zeros(b, kv_heads, _EXAMPLE_CAPACITY, head_dim, dtype=torch_dtype) for _ in range(2 * num_layers)]
    args: list[torch.Tensor] = [torch.ones(b, seq, dtype=torch.int64), torch.zeros(b, dtype=torch.int32)]
    rest_shapes: list[dict] = []
    if phase == "prefill":
        # Two positions per row in the example, so the positions dimension stays dynamic.
        args.append(torch.tensor([[seq - 2, seq - 1]] * b, dtype=torch.int64))
        rest_shapes.append({0: batch_dim, 1: k_dim})
    rest_shapes += [{0: batch_dim, 2: capacity_dim} for _ in cache]
    ids_shape = {0: batch_dim, 1: seq_dim} if phase == "prefill" else {0: batch_dim}
    input_names, output_names = graph_io_names(num_layers, phase)
    # torch.onnx prints its steps to stdout and warns about torchvision; keep stdout for --json.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            GraphWrapper(model, phase),
            tuple(args + cache),
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=(ids_shape, {0: batch_dim}, tuple(rest_shapes)),
            custom_translation_table=CUSTOM_TRANSLATION_TABLE,
            opset_version=OPSET,
            optimize=False,  # optimize_graph() below does the part of it these graphs need, 5x faster
            verbose=False,
        )
    return program.model


def optimize_graph(model: Any) -> None:
    """Constant folding and the clean-up rewrites that decoder graphs need, in place.

    torch.onnx's `optimize=True` runs onnxscript's whole default optimizer twice over, which took
    16-19 s of a 45 s SmolLM2-135M trace; most of it is rules that never match a decoder (the
    slice-to-split rule alone is 3.7 s). This keeps only the rules that fire on the families we
    export (or that tidy what they leave) and gives the same graph (same ops, same counts) in
    about 3.5 s."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.rules import common as rules

    optimizer.inline(model)
    cleanups = [
        rules.no_op_cast_rule, rules.no_op_expand_rule, rules.no_op_transpose_rule, rules.cast_cast_rule,
        rules.add_0_rule, rules.sub_0_rule, rules.mul_by_1_rule, rules.div_by_1_rule,
        rules.dropout_inference_rule, rules.dropout_zero_rule,
        rules.collapse_slice_rule, rules.collapse_slice2_rule, rules.reshape_reshape_rule,
        rules.squeeze_reshape_1d_rule, rules.transpose_transpose_rule, rules.unsqueeze_unsqueeze_rule,
        rules.materialize_reshape_shape_rule, rules.cast_constant_of_shape_rule,
        rules.cast_constant_of_shape_without_value_rule, rules.one_reshape_matmul_reshape_rule,
        rules.two_reshapes_matmul_reshape_rule, *rules.expand_before_binary_op_rules,
    ]
    for _ in range(2):  # the second round catches what folding the first one's output exposes
        optimizer.fold_constants(model, onnx_shape_inference=True)
        passes.RemoveUnusedNodesPass()(model)
        rewriter.rewrite(model, pattern_rewrite_rules=cleanups)
    optimizer.fold_constants(model, onnx_shape_inference=True)
    ir.passes.Sequential(
        passes.RemoveUnusedNodesPass(),
        passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        passes.DeduplicateInitializersPass(),
        passes.CommonSubexpressionEliminationPass(),  # the per-layer shape arithmetic is the same
        passes.RemoveUnusedNodesPass(),
        passes.OutputFixPass(),
        passes.NameFixPass(),
    )(model)


def measure_quantized(model_dir: Path, folder: Path, hf_model: Any, dtype: str) -> dict[str, Any]:
    """A quantised export against the fp32 model it came from (Hugging Face eager, which the fp32
    export matches to ~1e-4): max logit error, greedy agreement over 32 tokens on kvforge's parity
    prompts, and perplexity on 1024 tokens of its fixed text."""
    from kvforge.exporter.parity import run_parity

    report = run_parity(model_dir, folder, new_tokens=32, hf_model=hf_model)
    steps = sum(len(p.step_max_abs_err) for p in report.prompts)
    agree = sum(len(p.step_max_abs_err) - len(p.mismatched_steps) - len(p.tie_steps) for p in report.prompts)
    ppl = report.perplexity or {}
    return {"reference": "fp32 model (Hugging Face eager)", "max_abs_logit_err": round(float(report.max_abs_err), 4),
            "greedy_agreement": f"{agree}/{steps}", "perplexity": round(ppl.get("export", float("nan")), 4),
            "reference_perplexity": round(ppl.get("hf", float("nan")), 4),
            "perplexity_relative_increase": round(ppl.get("export", 0) / ppl.get("hf", 1) - 1, 5),
            "perplexity_tokens": ppl.get("tokens")}


def fuse_graph(model: Any, target: str) -> dict[str, int]:
    """The fusions of exporter/fusions.py that suit `target`: ONNX Runtime's normalization and rotary
    contrib ops for `ort`; merged parallel MatMuls for every target."""
    from kvforge.exporter.fusions import drop_reshape_round_trips, fuse_for_ort, fuse_parallel_matmuls

    counts = fuse_for_ort(model) if target == "ort" else {}
    counts["parallel_matmuls"] = fuse_parallel_matmuls(model)
    counts["reshape_round_trips"] = drop_reshape_round_trips(model)
    return counts


def derive_decode_graph(prefill: Any) -> Any:
    """decode.onnx from the canonical prefill graph, without a second trace: the same graph with
    input_ids [B, 1], the `logits_index` input replaced by zeros [B, 1] (the one new position) and
    logits [B, 1, V] squeezed to [B, V]. The clone shares the weight tensors."""
    import onnx_ir as ir

    model = prefill.clone()
    graph = model.graph
    by_name = {value.name: value for value in graph.inputs}
    index, past_lens, ids = by_name["logits_index"], by_name["past_lens"], by_name["input_ids"]
    tape = ir.tape.Tape()
    batch = tape.op("Shape", [past_lens])
    one = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64), name="kvforge_one_d")})
    shape = tape.op("Concat", [batch, one], attributes={"axis": 0})
    zeros = tape.op("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.array([0], np.int64))})
    graph.insert_before(graph.node(0), tape.nodes)
    index.replace_all_uses_with(zeros)
    graph.inputs.remove(index)
    ids.shape = ir.Shape([ids.shape[0], 1])
    position = next(i for i, value in enumerate(graph.outputs) if value.name == "logits")
    per_position = graph.outputs[position]
    per_position.name = "logits_positions"
    squeeze = ir.tape.Tape()
    logits = squeeze.op("Squeeze", [per_position, one], output=ir.Value(name="logits"))
    graph.extend(squeeze.nodes)
    logits.dtype, logits.shape = per_position.dtype, ir.Shape([per_position.shape[0], per_position.shape[2]])
    graph.outputs[position] = logits
    return model


def _io_spec(values) -> list[dict[str, Any]]:
    spec = []
    for value in values:
        shape = [dim if isinstance(dim, int) else str(dim) for dim in value.shape]
        spec.append({"name": value.name, "dtype": value.dtype.numpy().name, "shape": shape})
    return spec


def _graph_summary(model) -> dict[str, Any]:
    counts = Counter(f"{node.domain}.{node.op_type}" if node.domain else node.op_type for node in model.graph)
    attention = {op: n for op, n in counts.items() if op.endswith(("GroupQueryAttention", "Attention"))}
    return {"nodes": sum(counts.values()), "attention": attention, "op_counts": dict(sorted(counts.items()))}


def _chat_template_source(folder: Path) -> str | None:
    """Where the export's chat template lives (transformers 5 writes chat_template.jinja; older
    tokenizers keep it in tokenizer_config.json), or None."""
    if (folder / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            if isinstance(json.loads(config.read_text()).get("chat_template"), str):
                return "tokenizer_config.json"
        except ValueError:
            pass
    return None


def exporter_source_digest() -> str:
    """sha256 (16 hex) of the code that decides an export's bytes: kvforge's exporter, model adapters and
    attention op. The version string alone does not change between commits, so a cached export (the
    demo's) is reused only when this matches too."""
    import importlib

    digest = hashlib.sha256()
    for package in ("kvforge.exporter", "kvforge.models", "kvforge.plugins"):
        folder = Path(next(iter(importlib.import_module(package).__path__)))
        for file in sorted(folder.glob("*.py")):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def tool_versions() -> dict[str, str]:
    """The versions of the packages an export's bytes depend on (recorded in the manifest)."""
    versions = {}
    for package in ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    target: str = "ort",
    dtype: str = "fp32",
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    hf_dir: str | Path | None = None,
    quantize: str | None = None,
    block_size: int = 32,
    accuracy_level: int = 4,
    lm_head_bits: int | None = None,
) -> dict[str, Any]:
    """Export a local HF causal LM folder, or a GGUF file (converted first into `hf_dir`, default
    OUT_DIR.hf beside the output, and reused while the GGUF is unchanged). `quantize` ("int4" or
    "int8") quantises every weight matrix block-wise with ONNX Runtime's MatMulNBits quantiser and
    records the accuracy cost in the manifest (`lm_head_bits=8`: an 8-bit lm_head with int4). Returns the manifest that was written to `out_dir`."""
    from kvforge.exporter.lowering import TARGETS, lower

    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir).absolute()
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    check_quantize(quantize, block_size, dtype, lm_head_bits)
    if quantize is not None and target != "ort":
        raise InputError(f"--quantize produces ONNX Runtime's MatMulNBits: use it with --target ort, not {target}")
    gguf_record = None
    converted_s = None
    gguf_file = find_gguf(model_dir) if Path(model_dir).exists() else None
    if gguf_file is not None:
        # A GGUF file: convert it (or reuse its conversion) to a Hugging Face folder, then export that.
        hf_dir = Path(hf_dir) if hf_dir is not None else out_dir.parent / f"{out_dir.name}.hf"
        check_output(out_dir, [gguf_file.resolve(), hf_dir.absolute()], force=force, marker=MANIFEST_NAME)
        converting, converted = time.perf_counter(), []

        def watch(message: str) -> None:  # a reused conversion is not reported as one
            converted.append(message.startswith("converting "))
            say(message)

        model_dir = convert_gguf(gguf_file, hf_dir, progress=watch)
        converted_s = time.perf_counter() - converting if any(converted) else None
        gguf_record = json.loads((Path(model_dir) / GGUF_MARKER).read_text())
    model_dir = Path(model_dir).resolve()
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    # Before any work: never replace something that is not an export, or that holds the model.
    check_output(out_dir, [model_dir], force=force, marker=MANIFEST_NAME)
    config = load_hf_config(model_dir)
    family = family_for(config)
    family.check(config)
    if target == "trt":
        _check_trt_kernel(config, family.head_dim(config), dtype)

    import torch

    started = time.perf_counter()
    num_layers = config.num_hidden_layers
    kv_heads = family.kv_heads(config)
    head_dim = family.head_dim(config)
    torch_dtype = getattr(torch, DTYPES[dtype])

    # The staging folder comes first, so an unwritable output fails before the slow work.
    with StagedFolder(out_dir, MANIFEST_NAME, sources=[model_dir], say=say) as staged:
        staging = staged.path
        assert staging is not None
        say(f"loading {model_dir.name} ({', '.join(config.architectures or [config.model_type])}, {dtype})")
        model = load_hf_model(model_dir, dtype)
        fault_point("export:model-loaded")
        # Where the export's time goes (manifest "export_seconds"): the profile `kvforge bench` reports.
        clock = {"load": time.perf_counter() - started}
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            clock[name] = clock.get(name, 0.0) + now - mark
            mark = now

        try:
            say("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it")
            prefill = _export_phase(model, "prefill", num_layers, kv_heads, head_dim, torch_dtype)
            lap("trace")
            optimize_graph(prefill)
            lap("optimize")
            fused = fuse_graph(prefill, target)
            lap("fuse")
            say("fused " + ", ".join(f"{count} {name}" for name, count in fused.items() if count))
            quantization = None
            if quantize is not None:
                say(f"quantising the weights to {quantize} (blocks of {block_size}, ONNX Runtime's MatMulNBits)")
                prefill, quantization = quantize_model(prefill, quantize, block_size, int(config.vocab_size),
                                                             accuracy_level, lm_head_bits)
                lap("quantize")
            graphs = {"prefill": prefill, "decode": derive_decode_graph(prefill)}
            rotary = rotary_caches(model, config.max_position_embeddings, DTYPES[dtype]) if target == "ort" else None
            for phase, graph in graphs.items():
                say(f"lowering {phase} attention for target {target}")
                lower(graph, target, rotary)
                graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
            lap("derive_and_lower")
            fault_point("export:graphs-built")
            say(f"writing graphs and the shared weights file {WEIGHTS_NAME}")
            sizes = save_with_shared_weights(graphs, staging, WEIGHTS_NAME)
            lap("write")
            fault_point("export:weights-written")
            for name in COPIED_FILES:
                if (model_dir / name).is_file():
                    shutil.copy2(model_dir / name, staging / name)
            if not (staging / "tokenizer.json").is_file():
                say("warning: no tokenizer.json in the model folder; generate will take token ids only")
            manifest = _manifest(config, model_dir, target, dtype, graphs, staging, head_dim, sizes)
            if gguf_record is not None:
                manifest["model"]["source_gguf"] = {k: gguf_record[k] for k in ("source", "bytes", "sha256",
                                                                                "architecture", "tensor_types")}
            if quantization is not None:
                quantization["weights_bytes"] = sizes["weights_bytes"]
                manifest["quantization"] = quantization
                write_manifest(staging, manifest)  # the measurement below loads the staged export
                say("measuring what quantisation costs against the fp32 model (logits, greedy tokens, perplexity)")
                quantization["accuracy"] = measure_quantized(model_dir, staging, model, dtype)
                lap("measure_quantized")
            clock["total"] = time.perf_counter() - started
            manifest["export_seconds"] = {name: round(value, 2) for name, value in clock.items()}
            write_manifest(staging, manifest)
            fault_point("export:manifest-written")
            staged.publish()
        except KvforgeError:
            raise
        except OSError as err:
            raise ExportError(
                f"export of {model_dir} failed writing {err.filename or out_dir}: {err.strerror or err}; "
                "nothing was changed at the output"
            ) from err
        except Exception as err:
            raise ExportError(f"export of {model_dir} failed: {type(err).__name__}: {_one_line(err)}") from err
    before = f"; converting the GGUF before it took {converted_s:.1f} s" if converted_s is not None else ""
    say(f"exported to {out_dir}: load, trace, optimise and write took {time.perf_counter() - started:.1f} s{before}")
    return manifest


def _manifest(config, model_dir, target, dtype, graphs, folder, head_dim, sizes) -> dict[str, Any]:
    eos = config.eos_token_id
    generation: dict[str, Any] = {}
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        eos = generation.get("eos_token_id", eos)
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST_NAME:
            files[path.name] = file_record(path)
    return {
        "format": FORMAT,
        "kvforge_version": __version__,
        "kvforge_source": exporter_source_digest(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": {
            "source": str(model_dir),
            "architecture": (config.architectures or [None])[0],
            "model_type": config.model_type,
            "vocab_size": config.vocab_size,
            "num_layers": config.num_hidden_layers,
            "num_heads": config.num_attention_heads,
            "num_kv_heads": family_for(config).kv_heads(config),
            "head_dim": head_dim,
            "hidden_size": config.hidden_size,
            "max_position_embeddings": config.max_position_embeddings,
            "bos_token_id": getattr(config, "bos_token_id", None),
            "eos_token_id": eos_list,
            "pad_token_id": getattr(config, "pad_token_id", None),
            "sliding_window": getattr(config, "sliding_window", None),
        },
        "target": target,
        "dtype": dtype,
        "kv_cache": {
            "layout": "BNSH",
            "dtype": DTYPES[dtype],
            "num_layers": config.num_hidden_layers,
            "num_kv_heads": family_for(config).kv_heads(config),
            "head_dim": head_dim,
            "max_capacity": config.max_position_embeddings,
        },
        "graphs": {
            phase: {"file": f"{phase}.onnx", **_graph_summary(graph),
                    "inputs": _io_spec(graph.graph.inputs), "outputs": _io_spec(graph.graph.outputs)}
            for phase, graph in graphs.items()
        },
        "weights": WEIGHTS_NAME,
        "weights_sharing": sizes,
        "chat_template": _chat_template_source(folder),
        "files": files,
        "generation": generation,
        "tools": tool_versions(),
    }
