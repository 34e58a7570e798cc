"""`kvforge export` of an encoder-decoder (models/encoder_decoders.py): encoder.onnx, prefill.onnx and decode.onnx
over one weights file, and the manifest's `encoder` record (kvforge/core/encoder_contract.py).

The model is loaded whole (eager), the encoder and the decoder's prefill traced once each (exporter/seq2seq_trace.py),
cleaned up and fused as a decoder-only export's graphs are, decode derived from prefill, and every graph lowered for
the target: the decoder's self attention as a decoder-only model's, the cross attention by
exporter/targets/cross_attention.py. Written through a staging folder, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.contract import DTYPES, KVLayout
from kvforge.core.encoder_contract import ENCODER, EncoderRecord
from kvforge.core.errors import ExportError, InputError, KvforgeError, UnsupportedModelError
from kvforge.core.manifest import MANIFEST_NAME, write_manifest
from kvforge.core.output_folder import StagedFolder, check_output
from kvforge.exporter.export_manifest import WEIGHTS_NAME, export_manifest
from kvforge.exporter.load import check_weight_files, one_line
from kvforge.exporter.options import ExportOptions
from kvforge.exporter.targets import ExportTarget
from kvforge.models.encoder_decoders import EncoderDecoderFamily

# What the model folder gives the export beside its weights (Whisper's feature extractor settings among them).
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "config.json", "preprocessor_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                "normalizer.json", "source.spm", "target.spm", "sentencepiece.bpe.model", "spiece.model")


def refuse_options(family: EncoderDecoderFamily, options: ExportOptions, target: ExportTarget) -> None:
    """What an encoder-decoder export does not do yet, refused in one line before anything loads."""
    if target.name not in ("ort", "onnx"):
        raise UnsupportedModelError(f"{family.model_type}: an encoder-decoder model, and --target {target.name} has no "
                                    "cross-attention kernel; export with --target ort or --target onnx")
    if options.quant_method not in (None, "rtn"):
        raise InputError(f"{family.model_type}: --quant-method {options.quant_method} is not supported for "
                         "encoder-decoder models yet; int4/int8 weights are rounded (rtn)")
    unsupported = {"--kv-cache": options.kv_cache,
                   "--eagle": getattr(options, "eagle", None), "--text-only": options.text_only or None}
    named = [flag for flag, value in unsupported.items() if value]
    if named:
        raise InputError(f"{family.model_type}: {', '.join(named)} is not supported for encoder-decoder models yet; "
                         "export without it")
    if options.dtype == "fp16" and not family.fp16:
        raise InputError(f"{family.model_type}: --dtype fp16 is not supported: its layers clamp an fp16 overflow only "
                         "when one happened (transformers tests `torch.isfinite(...).all()`), a data-dependent branch "
                         "torch.export cannot trace; export fp32")
    if options.dtype == "bf16":
        raise InputError(f"{family.model_type}: --dtype bf16 is not supported for encoder-decoder models yet; export "
                         "fp32 or fp16")


def load_encoder_decoder(model_dir: Path, family: EncoderDecoderFamily, dtype: str) -> Any:
    """The HF model with its eager attention, in eval mode; a tensor missing or of another shape refused."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    auto = getattr(transformers, family.auto)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="eager",
                                           local_files_only=True, use_safetensors=True, trust_remote_code=False,
                                           output_loading_info=True)
    except Exception as err:  # safetensors, transformers and torch each raise their own types
        raise InputError(f"could not load the weights of {model_dir}: {type(err).__name__}: {one_line(err)}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [name for name in info.get("missing_keys", ()) if "embed_positions" not in name]
    if missing or info.get("mismatched_keys"):
        what = f"lacks {missing[0]}" if missing else f"holds {info['mismatched_keys'][0][0]} in another shape"
        raise InputError(f"{model_dir} {what}: the checkpoint does not match its config.json")
    return model.eval()


def export_encoder_decoder(model_dir: Path, out_dir: Path, options: ExportOptions, target: ExportTarget,
                           family: EncoderDecoderFamily, say: Callable[[str], None]) -> dict[str, Any]:
    """The three graphs, their weights and the manifest at `out_dir`; returns the manifest."""
    refuse_options(family, options, target)
    check_output(out_dir, [model_dir], force=options.force, marker=MANIFEST_NAME)
    check_weight_files(model_dir)
    started, clock = time.perf_counter(), {}
    say(f"loading the whole model ({family.model_type}, an encoder-decoder, {options.dtype})")
    model = load_encoder_decoder(model_dir, family, options.dtype)
    clock["load"] = time.perf_counter() - started
    config = model.config
    heads, head_dim = family.heads(config)
    layout = KVLayout(num_layers=family.decoder_layers(config), num_kv_heads=heads, head_dim=head_dim,
                      dtype=DTYPES[options.dtype], max_capacity=family.max_target(config))
    with StagedFolder(out_dir, MANIFEST_NAME, sources=[model_dir], say=say, force=options.force) as staged:
        assert staged.path is not None
        try:
            graphs, quantization = make_graphs(model, family, layout, target, options, model_dir, say, clock)
            manifest = _write(staged.path, model, family, layout, graphs, quantization, target, options, model_dir, say,
                              clock,
                              started)
            staged.publish()
        except KvforgeError:
            raise
        except Exception as err:
            raise ExportError(f"export of {model_dir} failed: {type(err).__name__}: {one_line(err)}") from err
    say(f"exported to {out_dir}: load, trace, optimise and write took {manifest['export_seconds']['total']:.1f} s")
    return manifest


def make_graphs(model: Any, family: EncoderDecoderFamily, layout: KVLayout, target: ExportTarget,
                options: ExportOptions, model_dir: Path, say: Callable[[str], None],
                clock: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """encoder, prefill and decode, lowered for `target`, in memory; the weight quantisation's record (or None)."""
    import torch

    from kvforge.exporter.lowering import lower
    from kvforge.exporter.optimize import fuse_graph, optimize_graph
    from kvforge.exporter.seq2seq_trace import trace_decoder, trace_encoder
    from kvforge.exporter.targets.cross_attention import lower_cross_attention
    from kvforge.exporter.trace import derive_decode_graph

    torch_dtype = getattr(torch, DTYPES[options.dtype])
    mark = time.perf_counter()
    say("tracing the encoder and the decoder once each (torch.onnx, dynamo); the decode graph is derived")
    encoder = trace_encoder(model, family, torch_dtype)
    prefill = trace_decoder(model, family, layout, torch_dtype)
    clock["trace"] = time.perf_counter() - mark
    quantization = None
    for graph in (encoder, prefill):
        optimize_graph(graph)
        fuse_graph(graph, target, quantized=options.quantize is not None, dtype=options.dtype,
                   merge_pairs=options.merge_pairs)
    if options.quantize is not None:  # every weight matrix rounded block-wise (MatMulNBits), as decoder-only
        from kvforge.exporter.checkpoint import open_checkpoint
        from kvforge.exporter.quantization import plan as quantization_plan

        source = quantization_plan.classify(open_checkpoint(model_dir), None, None)
        plan = quantization_plan.QuantPlan.resolve(options, source)  # its defaults (an 8-bit lm_head), with why
        encoder, encoder_record = plan.apply_to_graph(encoder, model.config.vocab_size)
        prefill, quantization = plan.apply_to_graph(prefill, model.config.vocab_size)
        quantization.update(plan.record(), encoder_matmuls_quantized=encoder_record["matmuls_quantized"])
        say(f"quantised {quantization['matmuls_quantized']} decoder and {encoder_record['matmuls_quantized']} "
            f"encoder weight matrices to {options.quantize}")
    graphs = {ENCODER: encoder, "prefill": prefill, "decode": derive_decode_graph(prefill)}
    for name, graph in graphs.items():
        say(f"lowering {name} attention for target {target.name}")
        crossed = lower_cross_attention(graph.graph, target.name)
        if not crossed:
            raise ExportError(f"the {name} graph has no cross-attention node: its attention was not routed through "
                              "kvforge's op")
        lower(graph, target, None, attends=name != ENCODER)
        graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    clock["optimize_and_lower"] = time.perf_counter() - mark - clock["trace"]
    return graphs, quantization


def encoder_record(model: Any, family: EncoderDecoderFamily, model_dir: Path) -> EncoderRecord:
    config = model.config
    heads, head_dim = family.heads(config)
    features = None
    if family.input == "features":
        settings = model_dir / "preprocessor_config.json"
        features = json.loads(settings.read_text()) if settings.is_file() else {}
        features = {**features, "feature_size": config.num_mel_bins,
                    "nb_max_frames": 2 * config.max_source_positions}
    return EncoderRecord(input=family.input, num_heads=heads, head_dim=head_dim, max_length=family.max_source(config),
                         hidden=config.d_model, decoder_start_token_id=family.start_token(model), features=features)


def _write(staging: Path, model: Any, family: EncoderDecoderFamily, layout: KVLayout, graphs: dict[str, Any],
           quantization: dict[str, Any] | None, target: ExportTarget, options: ExportOptions, model_dir: Path,
           say: Callable[[str], None], clock: dict[str, float], started: float) -> dict[str, Any]:
    from kvforge.exporter.weights import save_with_shared_weights

    say(f"writing graphs and the shared weights file {WEIGHTS_NAME}")
    mark = time.perf_counter()
    sizes = save_with_shared_weights(graphs, staging, WEIGHTS_NAME)
    clock["write"] = time.perf_counter() - mark
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, staging / name)
    clock["total"] = time.perf_counter() - started
    extra = {"encoder": encoder_record(model, family, model_dir).to_manifest(),
             "export_seconds": {name: round(value, 2) for name, value in clock.items()}}
    if quantization is not None:
        extra["quantization"] = {**quantization, "weights_bytes": sizes["weights_bytes"]}
    manifest = export_manifest(model.config, model_dir, target.core, options.dtype, layout, graphs, staging, sizes,
                               None, extra)
    write_manifest(staging, manifest)
    return manifest


def peek_family(model_dir: Path) -> EncoderDecoderFamily | None:
    """The encoder-decoder family of a model folder's config.json (read without transformers), or None."""
    from kvforge.models.encoder_decoders import encoder_decoder_family

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return encoder_decoder_family(raw.get("model_type")) if isinstance(raw, dict) else None
