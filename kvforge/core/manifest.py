"""The export folder's manifest, `kvforge.json`: its schema, how it is written and how it is checked.

Kept free of torch/onnx so the runtime can read it. Shapes and names the runtime needs come from
here and from kvforge/core/contract.py, never from model code. `compose()` writes the form below from
the contract's types; `load_manifest()` checks it (the same types' `from_manifest`).

Layout of the file (format "kvforge/3"; /2 repeated the KV layout under `model`):

    {
      "format": "kvforge/3",
      "kvforge_version": "0.1.0",
      "kvforge_source": "fe8adf7b45d7cd39",   # digest of the exporter code (a cached export is reused only if equal)
      "created": "2026-11-22T02:30:00Z",
      "model": ModelSpec,               # {"vocab_size", "num_heads", "eos_token_id": [...], "pad_token_id", ...}
      "target": "ort",                  # a name of kvforge/core/targets.py: "ort" | "onnx" | "trt"
      "dtype": "fp32",                  # weights/activations/KV dtype: "fp32" | "fp16" | "bf16"
      "kv_cache": KVLayout,             # {"num_layers", "num_kv_heads", "head_dim", "dtype", "max_capacity", "layout", ["layers"]}: layers only where they differ
      "kv_cache_quantization": {...},   # --kv-cache int8 only: scales' form and calibration (kv_cache.dtype "int8")
      "graphs": {
        "prefill": {"file": "prefill.onnx", "nodes": 123, "attention": {...}, "op_counts": {...},
                    "inputs":  [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}, ...],
                    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "positions", 512]}, ...]},
        "decode":  {...}
      },
      "weights": "model.weights",       # one external data file shared by both graphs
      "weights_sharing": {...},
      "chat_template": "chat_template.jinja" | "tokenizer_config.json" | null,
      "files": {"prefill.onnx": {"sha256": "...", "bytes": 123}, ...},
      "generation": {...},              # generation_config.json's sampling defaults, if any
      "tools": {"torch": "2.13.0", "transformers": "...", "onnx": "...", "onnxscript": "..."},
      "quantization": {...},            # --quantize only; "accuracy" added by the measurement after publish
      "export_seconds": {...}           # load, trace, ..., total; gguf_convert (outside total) if converted now
    }

The graph IO of each phase is `contract.GraphIO.of(phase, kv_layout)`; a manifest whose graphs
list other names is refused.

What a load checks (see README, "Safety and guarantees"): the structure above; that every file
the manifest names is a plain name inside the folder (no absolute paths, no `..`, no symlink out
of it) and is listed in `files`; every listed file's size; the sha256 of every file under
SMALL_FILE_BYTES (the graphs, tokenizer, configs); and with `verify_hashes` the sha256 of every
file, weights included. The graph bytes the runtime hands to ONNX Runtime are the bytes it hashed,
and every external-data file those bytes name is listed in `files` (`read_graph`). The fields the
runtime reads are type- and range-checked, sizes against the graphs' declared shapes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from kvforge.core.contract import (
    DTYPES,
    KV_KINDS,
    LOGITS,
    PHASES,
    GraphIO,
    KVLayout,
    ModelSpec,
    check_token_ids,
    parse_cache_name,
)
from kvforge.core.encoder_contract import check_encoder_manifest, decoder_io
from kvforge.core.errors import ManifestError
from kvforge.core.external_data import MalformedGraph, external_data_locations
from kvforge.core.vision_manifest import check_vision_manifest

FORMAT = "kvforge/3"
MANIFEST_NAME = "kvforge.json"
# Files smaller than this are always hashed on load (cheap); larger ones (weights) with verify.
SMALL_FILE_BYTES = 64 << 20


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Write `kvforge.json` atomically (a temporary file renamed over it): a reader sees the old
    manifest or the new one, never half of one."""
    path = Path(folder) / MANIFEST_NAME
    partial = path.with_name(f".{MANIFEST_NAME}.partial")
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    partial.replace(path)
    return path


def record_section(folder: str | Path, key: str, value: Any) -> dict[str, Any]:
    """Add or replace one top-level section of a published export's manifest (a measurement made
    after the export, such as `quantization.accuracy`), atomically. The sections the loader checks
    (files, graphs, model, kv_cache) are not for this."""
    if key in ("format", "files", "graphs", "model", "kv_cache", "target", "dtype", "weights"):
        raise ValueError(f"{key!r} is written by the export only")
    manifest = load_manifest(folder)
    manifest[key] = value
    write_manifest(Path(folder), manifest)
    return manifest


def io_spec(name: str, dtype: str, shape: list[int | str]) -> dict[str, Any]:
    """One graph input or output as the manifest lists it."""
    return {"name": name, "dtype": dtype, "shape": shape}


def io_names(graph: dict[str, Any], kind: str) -> list[str]:
    """The names of a manifest graph's "inputs" or "outputs"."""
    return [entry["name"] for entry in graph[kind]]


def io_entry(manifest: dict[str, Any], phase: str, name: str) -> dict[str, Any] | None:
    """The manifest's record of graph value `name` of `phase` (input or output), or None."""
    graph = manifest["graphs"][phase]
    return next((e for e in graph["inputs"] + graph["outputs"] if e["name"] == name), None)


def compose(
    *, model: ModelSpec, kv_cache: KVLayout, target: str, dtype: str, graphs: dict[str, dict[str, Any]],
    files: dict[str, dict[str, Any]], weights: str, **sections: Any,
) -> dict[str, Any]:
    """A manifest in the form above, from the contract's types. `graphs[phase]` holds "file",
    "inputs" and "outputs" (io_spec entries) and any summary; `sections` are recorded as given
    (kvforge_version, created, generation, tools, ...)."""
    head = {key: sections.pop(key) for key in ("kvforge_version", "kvforge_source", "created") if key in sections}
    return {
        "format": FORMAT, **head, "model": model.to_manifest(), "target": target, "dtype": dtype,
        "kv_cache": kv_cache.to_manifest(), "graphs": graphs, "weights": weights, **sections, "files": files,
    }


def resolve_in_folder(folder: Path, name: Any, what: str, kind: str = "export folder") -> Path:
    """`folder / name` for a plain relative file name of the manifest, or ManifestError if the name
    would leave the folder (absolute, `..`, or a symlink pointing outside)."""
    if not isinstance(name, str) or name == "":
        raise ManifestError(f"{folder / MANIFEST_NAME} names {what} {name!r}, which is not a file name; re-run the export")
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        # A NUL would stop the OS at it (Python refuses it outright); no export writes such names.
        raise ManifestError(
            f"{folder} lists {what} {name!r}, a name with a control character (NUL, newline, ...); refusing "
            "to open it (the manifest was crafted or corrupted): re-run the export"
        )
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or name.startswith(("/", "\\")) or ":" in name:
        raise ManifestError(
            f"{folder} lists {what} {name!r} outside the {kind}; refusing to open it "
            "(the manifest was crafted or corrupted): re-run the export"
        )
    path = folder / pure
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ManifestError(
            f"{path} is a link that leads outside the {kind}; refusing to open it: re-run the export"
        )
    return path


CHAT_TEMPLATE_SOURCES = ("chat_template.jinja", "tokenizer_config.json", None)  # what exports record


def _validate(manifest: Any, path: Path) -> None:
    """Structure checks with messages that name the entry, so a bad file never ends in a KeyError."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} holds a JSON {type(manifest).__name__}, not an object; re-run the export")
    if manifest.get("format") != FORMAT:
        raise ManifestError(
            f"{path} has format {manifest.get('format')!r}, this kvforge reads {FORMAT!r}; re-export with this version"
        )
    for key in ("model", "target", "dtype", "kv_cache", "graphs", "files"):
        if key not in manifest:
            raise ManifestError(f"{path} lacks the {key!r} entry; re-run the export")
    for section in ("model", "kv_cache"):
        if not isinstance(manifest[section], dict):
            raise ManifestError(f"{path}: {section!r} must be an object; re-run the export")
    if manifest["dtype"] not in DTYPES:
        raise ManifestError(f"{path}: dtype must be one of {', '.join(DTYPES)}, got {manifest['dtype']!r}; "
                            "re-run the export")
    try:
        layout = KVLayout.from_manifest(manifest)
        spec = ModelSpec.from_manifest(manifest)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from None
    if spec.max_position_embeddings is not None and layout.max_capacity > spec.max_position_embeddings:
        raise ManifestError(f"{path}: kv_cache.max_capacity {layout.max_capacity} is beyond the model's "
                            f"max_position_embeddings {spec.max_position_embeddings}; re-run the export")
    template = manifest.get("chat_template")
    if template not in CHAT_TEMPLATE_SOURCES:  # a path elsewhere was read as "no chat template"
        raise ManifestError(f"{path}: chat_template is {template!r}, which no export writes (one of "
                            f"{', '.join(map(repr, CHAT_TEMPLATE_SOURCES))}): the manifest is crafted or damaged; "
                            "re-run the export")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ManifestError(f"{path}: 'files' must be an object of file records; re-run the export")
    for name, record in files.items():
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("sha256"), str)
            or isinstance(record.get("bytes"), bool)
            or not isinstance(record.get("bytes"), int)
        ):
            raise ManifestError(f"{path}: files[{name!r}] must hold 'sha256' and 'bytes'; re-run the export")
    graphs = manifest["graphs"]
    if not isinstance(graphs, dict):
        raise ManifestError(f"{path}: 'graphs' must be an object; re-run the export")
    for phase in PHASES:
        graph = graphs.get(phase)
        if not isinstance(graph, dict):
            raise ManifestError(f"{path} lists no {phase!r} graph; re-run the export")
        if graph.get("file") not in files:
            raise ManifestError(
                f"{path}: the {phase} graph file {graph.get('file')!r} is not listed in 'files', so it could not "
                "be verified; re-run the export"
            )
        for kind in ("inputs", "outputs"):
            entries = graph.get(kind)
            if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
                raise ManifestError(f"{path}: graphs.{phase}.{kind} must be a list of {{'name': ...}}; re-run the export")
        expected = decoder_io(phase, layout) if manifest.get("encoder") is not None else \
            GraphIO.of_manifest(phase, layout, manifest)  # an encoder-decoder's decoder takes the cross keys too
        expected.check(io_names(graph, "inputs"), io_names(graph, "outputs"), str(path))
        _check_declared_shapes(manifest, phase, layout, path)
    if manifest.get("vision") is not None:
        check_vision_manifest(manifest, path, spec.vocab_size)
    if manifest.get("encoder") is not None:
        check_encoder_manifest(manifest, path, layout)
    if manifest.get("draft") is not None:  # a speculation head (kvforge/core/draft_manifest.py)
        from kvforge.core.draft_manifest import check_draft

        check_draft(manifest, path, layout)
    weights = manifest.get("weights")
    if weights is not None and (not isinstance(weights, str) or weights not in files):
        raise ManifestError(f"{path}: the weights file {weights!r} is not listed in 'files'; re-run the export")
    _check_generation(manifest.get("generation"), path, spec.vocab_size)


def _check_declared_shapes(manifest: dict[str, Any], phase: str, layout: KVLayout, path: Path) -> None:
    """The sizes the runtime allocates by (vocab_size, KV heads, head_dim) must be the ones the
    graph entries declare: a crafted size would otherwise allocate by it (1e12 logits) or fail mid-run.
    (The backends check these entries against the graph files themselves.)"""
    vocab = manifest["model"]["vocab_size"]
    for entry in manifest["graphs"][phase]["inputs"] + manifest["graphs"][phase]["outputs"]:
        shape = entry.get("shape")
        if shape is None:
            continue
        if not isinstance(shape, list) or not all(
            isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape
        ):
            raise ManifestError(
                f"{path}: graphs.{phase} {entry['name']} has shape {shape!r}; a shape is a list of sizes and names: "
                "re-run the export"
            )
        if entry["name"] == LOGITS and shape and isinstance(shape[-1], int) and shape[-1] != vocab:
            raise ManifestError(
                f"{path}: model.vocab_size is {vocab}, but the {phase} graph's logits have {shape[-1]} per position; "
                "the manifest was modified: re-run the export"
            )
        cache = parse_cache_name(entry["name"])
        kv_buffer = cache is not None and cache[1] in KV_KINDS and cache[2] < layout.num_layers \
            and layout.has_kv(cache[2])
        if kv_buffer and len(shape) == 4:
            heads, head_dim = layout.layer_shape(cache[2])
            where = f"layers[{cache[2]}]." if layout.layers else ""
            for axis, (what, want) in ((1, ("num_kv_heads", heads)), (3, ("head_dim", head_dim))):
                if isinstance(shape[axis], int) and shape[axis] != want:
                    raise ManifestError(
                        f"{path}: kv_cache.{where}{what} is {want}, but the {phase} graph's {entry['name']} has shape "
                        f"{shape}; the manifest was modified: re-run the export"
                    )


def _check_generation(generation: Any, path: Path, vocab_size: int) -> None:
    """`generation` (generation_config.json's defaults): an object whose sampling keys have the
    types the runtime reads them as."""
    if generation is None:
        return
    if not isinstance(generation, dict):
        raise ManifestError(
            f"{path}: 'generation' must be an object (generation_config.json's defaults), got {generation!r}; "
            "re-run the export"
        )

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    checks = {
        "do_sample": (lambda v: isinstance(v, bool), "true or false"),
        "temperature": (number, "a number"),
        "top_p": (number, "a number"),
        "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    }
    for key, (valid, wanted) in checks.items():
        value = generation.get(key)
        if value is not None and not valid(value):
            raise ManifestError(f"{path}: generation.{key} must be {wanted} or null, got {value!r}; re-run the export")
    try:
        check_token_ids(generation, "generation", vocab_size)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from None


def _export_beside(model: Path) -> Path:
    """Where to suggest exporting `model` (a folder, or a file without its suffix): NAME-export beside it."""
    if model.name in ("", ".", ".."):  # `.`: its real name
        model = model.resolve()
    return model.with_name(f"{model.name}-export")


def load_manifest(folder: str | Path, verify_hashes: bool = False) -> dict[str, Any]:
    """Read and check `kvforge.json` (see the module docstring for what is checked).
    `verify_hashes` also re-hashes the large files (the weights), which reads them once."""
    folder = Path(folder)
    if not folder.is_dir():
        if folder.is_file() and folder.suffix.lower() == ".gguf":
            raise ManifestError(f"{folder} is a GGUF model file, not a kvforge export: export it first (`kvforge "
                                f"export {folder} -o {_export_beside(folder.with_suffix(''))}`) and pass that folder")
        if not folder.exists():
            raise ManifestError(f"{folder} does not exist; pass the output folder of `kvforge export`")
        raise ManifestError(f"{folder} is a file, not a folder; pass the output folder of `kvforge export`")
    path = folder / MANIFEST_NAME
    if not path.is_file():
        if (folder / "config.json").is_file() and not (folder / "prefill.onnx").is_file():  # a model, not an export
            raise ManifestError(f"{folder} is a Hugging Face model folder, not a kvforge export: export it first "
                                f"(`kvforge export {folder} -o {_export_beside(folder)}`) and pass that folder")
        if (folder / "prefill.onnx").is_file() or (folder / "decode.onnx").is_file():
            raise ManifestError(f"{folder} holds an export's graphs but no {MANIFEST_NAME}: the export is damaged "
                                "(its manifest was removed, or it never finished); re-run the export")
        raise ManifestError(f"{folder} has no {MANIFEST_NAME}: it is not a kvforge export (`kvforge export MODEL_DIR "
                            "-o OUT_DIR` makes one; pass OUT_DIR)")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); re-run the export") from err
    _validate(manifest, path)
    for name, record in manifest["files"].items():
        file = resolve_in_folder(folder, name, "the file")
        if not file.is_file():
            raise ManifestError(f"{folder} is missing {name}, which its manifest lists; re-run the export")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise ManifestError(f"{file} has {size} bytes, the manifest says {record['bytes']}: truncated or replaced; re-run the export")
        if (verify_hashes or size < SMALL_FILE_BYTES) and sha256_file(file) != record["sha256"]:
            raise ManifestError(
                f"{file} does not match the sha256 in {MANIFEST_NAME}: the file was modified or corrupted; re-run the export"
            )
    return manifest


def read_graph(folder: str | Path, manifest: dict[str, Any], phase: str) -> bytes:
    """The bytes of a phase's graph file, checked against the manifest's sha256: the runtime
    hands these very bytes to ONNX Runtime, so what is verified is what is loaded."""
    folder = Path(folder)
    name = manifest["graphs"][phase]["file"]
    path = resolve_in_folder(folder, name, f"the {phase} graph")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ManifestError(f"could not read {path}: {err.strerror or err}; re-run the export") from err
    record = manifest["files"].get(name)
    if record is None or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ManifestError(
            f"{path} does not match the sha256 in {MANIFEST_NAME}: the file was modified or corrupted; re-run the export"
        )
    check_external_data(folder, manifest, phase, data)
    return data


def check_external_data(folder: Path, manifest: dict[str, Any], phase: str, data: bytes) -> None:
    """ManifestError unless every external-data file the graph `data` takes tensors from is a plain
    name inside `folder` listed in the manifest's `files` (so its size is checked on every load and
    its sha256 with verify): otherwise a graph could load weights that nothing verified."""
    path = folder / manifest["graphs"][phase]["file"]
    try:
        locations = external_data_locations(data)
    except MalformedGraph as err:
        raise ManifestError(f"{path} is not a valid ONNX graph ({err}); re-run the export") from None
    for location in sorted(locations):
        resolve_in_folder(folder, location, f"the external data of the {phase} graph")
        if str(PurePosixPath(location.replace("\\", "/"))) not in manifest["files"]:
            raise ManifestError(
                f"{path} takes tensors from {location!r}, which {MANIFEST_NAME} does not list in 'files' (it lists "
                f"{manifest.get('weights')!r} as the weights), so they could not be verified; refusing to load it: "
                "re-run the export"
            )
