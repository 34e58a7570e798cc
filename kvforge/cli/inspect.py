"""`kvforge inspect`: what an export folder holds, from its manifest (no onnx import needed), and the
TensorRT engines built into its engines/ folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.contract import DRAFT, PHASES, VISION
from kvforge.core.engine_plan import (
    ENGINE_DIR_NAME,
    RECORD_DIGEST,
    engine_file_problem,
    load_engines_manifest,
)
from kvforge.core.errors import ManifestError
from kvforge.core.manifest import load_manifest, read_graph


def describe(export_dir: str | Path, verify: bool = False) -> dict[str, Any]:
    """The manifest's view of an export folder, checked as a loader checks it; `verify` re-hashes
    every file (weights and engines included), so `verified` says whether that was done."""
    manifest = load_manifest(export_dir, verify_hashes=verify)
    extra = [name for name in (VISION, DRAFT, "encoder") if manifest.get(name) is not None]
    for phase in (*PHASES, *extra):  # as a backend reads them: the files their external data comes from must be listed
        read_graph(export_dir, manifest, phase)
    graphs = {}
    for phase, graph in manifest["graphs"].items():
        graphs[phase] = {
            "file": graph["file"],
            "nodes": graph.get("nodes"),
            "attention_nodes": graph.get("attention"),
            "op_counts": graph.get("op_counts", {}),
            "inputs": graph["inputs"],
            "outputs": graph["outputs"],
        }
    return {"folder": str(Path(export_dir).resolve()), "verified": verify, "graphs": graphs, "proposer": proposer(manifest),
            "files": manifest["files"], "manifest": manifest, "engines": describe_engines(export_dir, verify)}


def architecture(manifest: dict[str, Any]) -> str:
    """The exported model as inspect names it: a vision-language checkpoint exported whole by its whole model's
    architecture (LlavaForConditionalGeneration) and its text model's; any other by its own."""
    model = manifest["model"]
    whole = model.get("text_of") if manifest.get("vision") is not None else None
    if not isinstance(whole, dict) or not whole.get("architecture"):
        return model["architecture"]
    return f"{whole['architecture']} (text model {model['architecture']}, image tower in vision.onnx)"


def proposer(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The speculation head an export carries (its manifest's "draft" record), as inspect names it; None without."""
    record = manifest.get(DRAFT)
    if not isinstance(record, dict):
        return None
    method = {"eagle3": "eagle", "mtp": "mtp"}.get(record.get("kind"))
    out = {"method": method, "kind": record.get("kind"), "graph": record.get("file")}
    if record.get("kind") == "eagle3":
        out.update(aux_layer_ids=record.get("aux_layer_ids"), draft_vocab_size=record.get("draft_vocab_size"))
    else:
        out.update(mtp_layers=record.get("mtp_layers"))
    if record.get("lm_head_bits") is not None:  # --draft-lm-head-bits: a MatMulNBits lm_head
        out["lm_head_bits"] = record["lm_head_bits"]
    return out


def quantization_lines(manifest: dict[str, Any]) -> list[str]:
    """inspect's lines for the export's quantisation plan: what was made integers, and why where it was a default
    (the reasons exporter/quantization/plan.py recorded)."""
    quant, lines = manifest.get("quantization"), []
    if isinstance(quant, dict):
        head = f", {quant['lm_head_bits']}-bit lm_head" if quant.get("lm_head_bits") not in (None, quant.get("bits")) else ""
        lines.append(f"  quantization: int{quant.get('bits')} weights ({quant.get('quant_method', 'rtn')}), blocks of "
                     f"{quant.get('block_size')}, accuracy level {quant.get('accuracy_level')}{head}; "
                     f"{quant.get('matmuls_quantized')} MatMulNBits")
        lines += [f"    why {what}: {quant[key]}" for key, what in (("quant_method_default", "the method"),
                                                                  ("lm_head_bits_default", "the lm_head"))
                  if quant.get(key)]
        carried = quant.get("integer_weights")
        if isinstance(carried, dict):
            lines.append(f"    integers: {carried.get('carried_over')} matrices carried over from the "
                         f"{carried.get('source')} as they are, {len(carried.get('rounded', []))} rounded")
        if quant.get("moe_experts"):
            lines.append(f"    experts: {quant['moe_experts']}")
    kv = manifest.get("kv_cache_quantization")
    if isinstance(kv, dict):
        lines.append(f"  KV cache: {kv.get('dtype')}")
    return lines


def proposer_line(info: dict[str, Any]) -> str:
    """inspect's line for the export's speculation head (an encoder-decoder's: what its encoder takes)."""
    head, encoder = info.get("proposer"), info["manifest"].get("encoder")
    if encoder is not None:
        takes = ("log-mel features, {feature_size} bins x {nb_max_frames} frames".format(**encoder["features"])
                 if encoder["input"] == "features" else f"token ids, up to {encoder['max_length']}")
        return (f"  encoder-decoder: the encoder takes {takes}; cross keys/values {encoder['num_heads']} heads x "
                f"{encoder['head_dim']}; decoding starts at token {encoder['decoder_start_token_id']}")
    if head is None:
        return "  speculation head: none (prompt lookup and --draft exports still speculate)"
    if head["kind"] == "eagle3":
        what = (f"EAGLE-3 head, reads layers {head['aux_layer_ids']}, draft vocabulary {head['draft_vocab_size']}")
    else:
        what = f"MTP layer 1 of {head['mtp_layers']}"
    if head.get("lm_head_bits") is not None:
        what += f", {head['lm_head_bits']}-bit lm_head"
    return f"  speculation head: {what}, in {head['graph']} (--speculate {head['method']})"


def describe_engines(export_dir: str | Path, verify: bool = False) -> dict[str, Any]:
    """The engine folder EXPORT_DIR/engines, checked as the TensorRT backend checks it (engines.json's
    format and own sha256, that it was built from this export, each engine's size); `verify` also
    hashes every engine. No engines/ folder (or an empty one) is no engines, not an error.
    `record_sha256`: whether engines.json records a sha256 of itself (an older kvforge's does not:
    its engine files are still checked against it, but its own content is unverified)."""
    export_dir = Path(export_dir)
    engine_dir = export_dir / ENGINE_DIR_NAME
    if not engine_dir.exists() or (engine_dir.is_dir() and not any(engine_dir.iterdir())):
        return {"folder": str(engine_dir), "built": False}
    record = load_engines_manifest(engine_dir, export_dir)
    if verify:
        for name, entry in record.get("files", {}).items():
            problem = engine_file_problem(engine_dir, name, entry)
            if problem is not None:
                raise ManifestError(f"{problem}; rebuild with `kvforge build {export_dir} --force`")
    return {"folder": str(engine_dir), "built": True, "verified": verify, "record_sha256": RECORD_DIGEST in record,
            "files": record.get("files", {}), "engines": record.get("engines", {}),
            "tensorrt": record.get("tensorrt", {}), "gpu": record.get("gpu", {}), "options": record.get("options", {})}
