"""What an export's manifest records about it (kvforge/core/manifest.py gives the manifest its form): the
graphs' IO and op counts, the model it came from, where its chat template lives, and the exporter code
and tool versions that made its bytes (a cached export is reused only while they match)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from kvforge.core import __version__
from kvforge.core.contract import KVLayout, ModelSpec
from kvforge.core.manifest import MANIFEST_NAME, compose, file_record, io_spec
from kvforge.core.targets import Target
from kvforge.exporter.text_model import text_of
from kvforge.models.config_values import config_value
from kvforge.models.hub import hub_record

WEIGHTS_NAME = "model.weights"  # the one external-data file both graphs read


def _io_spec(values) -> list[dict[str, Any]]:
    return [io_spec(value.name, value.dtype.numpy().name, [dim if isinstance(dim, int) else str(dim) for dim in value.shape])
            for value in values]


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
    """sha256 (16 hex) of the code that decides an export's bytes: kvforge's exporter, model adapters,
    attention op, and the contracts and manifest form they follow. The version string alone does not
    change between commits, so a cached export (the demo's) is reused only when this matches too."""
    import importlib

    import kvforge

    digest = hashlib.sha256()
    base = Path(next(iter(kvforge.__path__))) / "core"
    files = [base / f"{name}.py" for name in ("contract", "targets", "manifest")]
    for package in ("kvforge.exporter", "kvforge.models", "kvforge.plugins"):
        files += sorted(Path(next(iter(importlib.import_module(package).__path__))).rglob("*.py"))
    for file in files:
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


TOKEN_ID_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _in_vocabulary(ids: dict[str, Any], vocab_size: int, where: str, dropped: dict[str, Any]) -> dict[str, Any]:
    """`ids` (eos an id or a list; bos and pad may be -1, Hugging Face's "none") without the ids outside the
    vocabulary, each dropped one recorded in `dropped` under "where.field"."""
    def valid(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size

    out = {}
    for name, value in ids.items():
        if isinstance(value, list | tuple):
            out[name] = [v for v in value if valid(v)]
            gone = [v for v in value if not valid(v)]
        elif value is None or valid(value) or (name != "eos_token_id" and value == -1):
            out[name], gone = value, []
        else:
            out[name], gone = None, [value]
        if gone:
            dropped[f"{where}.{name}"] = gone
    return out


def export_manifest(config, model_dir, target: Target, dtype: str, layout: KVLayout, graphs, folder: Path, sizes,
              gguf_record, extra: dict[str, Any]) -> dict[str, Any]:
    eos = config.eos_token_id
    generation: dict[str, Any] = {}
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        eos = generation.get("eos_token_id", eos)
    # Ids the model cannot emit (a checkpoint whose vocabulary was trimmed) never matter to generation, and
    # the loader refuses them: they are left out here, and the manifest says which (dropped_token_ids).
    dropped: dict[str, Any] = {}
    ids = _in_vocabulary({"eos_token_id": eos, "bos_token_id": getattr(config, "bos_token_id", None),
                          "pad_token_id": getattr(config, "pad_token_id", None)}, config.vocab_size, "model", dropped)
    generation = {**generation, **_in_vocabulary({k: generation[k] for k in TOKEN_ID_FIELDS if k in generation},
                                                 config.vocab_size, "generation", dropped)}
    eos = ids["eos_token_id"]
    eos_list = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    spec = ModelSpec(
        # A state-space model has no attention heads: its query heads are named 1 (it has no KV to size).
        vocab_size=config.vocab_size, num_heads=config_value(config, "num_attention_heads") or 1,
        hidden_size=config.hidden_size, max_position_embeddings=layout.max_capacity, bos_token_id=ids["bos_token_id"],
        eos_token_id=eos_list, pad_token_id=ids["pad_token_id"],
        sliding_window=getattr(config, "sliding_window", None), source=str(model_dir),
        architecture=(config.architectures or [None])[0], model_type=config.model_type,
    )
    model = spec.to_manifest()
    if text_of(config) is not None:  # a multimodal checkpoint: its text model was exported (exporter/text_model.py)
        model["text_of"] = text_of(config)
    if dropped:
        model["dropped_token_ids"] = dropped
    if gguf_record is not None:
        model["source_gguf"] = {k: gguf_record[k] for k in ("source", "bytes", "sha256", "architecture", "tensor_types")}
    hub = hub_record(model_dir)
    if hub is not None:  # taken from huggingface_hub's cache: which repository, at which commit
        model["hub"] = hub
    files = {path.name: file_record(path) for path in sorted(folder.iterdir())
             if path.is_file() and path.name not in (MANIFEST_NAME, WEIGHTS_NAME)}
    if (folder / WEIGHTS_NAME).is_file():  # hashed as it was written (exporter/weights.py)
        files[WEIGHTS_NAME] = {"sha256": sizes["weights_sha256"], "bytes": (folder / WEIGHTS_NAME).stat().st_size}
        files = dict(sorted(files.items()))
    manifest = compose(
        model=spec, kv_cache=layout, target=target.name, dtype=dtype, weights=WEIGHTS_NAME, files=files,
        graphs={phase: {"file": f"{phase}.onnx", **_graph_summary(graph),
                        "inputs": _io_spec(graph.graph.inputs), "outputs": _io_spec(graph.graph.outputs)}
                for phase, graph in graphs.items()},
        kvforge_version=__version__, kvforge_source=exporter_source_digest(),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        weights_sharing={k: v for k, v in sizes.items() if k != "weights_sha256"}, chat_template=_chat_template_source(folder), generation=generation,
        tools=tool_versions(), **extra,
    )
    manifest["model"] = model
    return manifest
