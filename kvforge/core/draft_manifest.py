"""The manifest's "draft" record (a speculation head's draft.onnx beside the target's graphs), checked at load like
the vision record: its fields the runtime allocates and binds by, and the head graph's IO and declared shapes.

Record (exporter/draft_head.py writes kind "eagle3"; exporter/mtp_head.py kind "mtp"):

    "draft": {
      "kind": "eagle3",                 # contract.DRAFT_KINDS
      "file": "draft.onnx",             # listed in "files" and as graphs.draft.file
      "kv_cache": KVLayout,             # the head's own cache (num_layers 1, its kv heads and head_dim, dtype, capacity)
      "hidden_size": 64,                # H: draft_hidden / hidden_out width
      "target_hidden_size": 192,        # Dt: target_hidden width (eagle3: len(aux_layer_ids) * model.hidden_size)
      # only with --draft-lm-head-bits (absent: the lm_head in the export's float dtype; exporter/quantization/draft_lm_head.py):
      "lm_head_bits": 8,                # 8 or 4: the lm_head is a MatMulNBits of these bits
      "lm_head_block_size": 32,
      # eagle3 only:
      "format": "speculators" | "eagle", "source": "/path/to/head", "num_heads": 4,
      "aux_layer_ids": [1, 3, 6],       # the target layers whose *inputs* are concatenated, ascending
      "draft_vocab_size": 128,          # Vd: logits width and token_map length
      "norm_before_residual": false
    }
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.contract import (
    DRAFT,
    DRAFT_HIDDEN,
    DRAFT_KINDS,
    HIDDEN_OUT,
    LOGITS,
    PHASES,
    TARGET_HIDDEN,
    TOKEN_MAP,
    GraphIO,
    KVLayout,
    is_int,
    parse_cache_name,
)
from kvforge.core.errors import ManifestError

_MAX_WIDTH = 1 << 20  # far beyond any hidden size, far below a crafted size that allocates by it


def _names(graph: dict[str, Any], kind: str, path: Path) -> list[str]:
    entries = graph.get(kind)
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
        raise ManifestError(f"{path}: graphs.{DRAFT}.{kind} must be a list of {{'name': ...}}; re-run the export")
    return [e["name"] for e in entries]


def _width(record: dict[str, Any], field: str, path: Path, top: int = _MAX_WIDTH) -> int:
    value = record.get(field)
    if not is_int(value) or not 1 <= value <= top:
        raise ManifestError(f"{path}: draft.{field} is {value!r}, not an integer in 1..{top}; re-run the export")
    return value


def _last_dims(manifest: dict[str, Any], phase: str, want: dict[str, int], path: Path) -> None:
    """The named entries of `phase`'s graph whose last declared size is an integer must have the recorded size."""
    graph = manifest["graphs"][phase]
    for entry in graph.get("inputs", []) + graph.get("outputs", []):
        shape, name = entry.get("shape"), entry.get("name")
        if name in want and isinstance(shape, list) and shape and is_int(shape[-1]) and shape[-1] != want[name]:
            raise ManifestError(f"{path}: the {phase} graph's {name} has shape {shape}, but the draft record says "
                                f"{want[name]} per position; the manifest was modified: re-run the export")


def _cache_shapes(graph: dict[str, Any], head: KVLayout, path: Path) -> None:
    """The head graph's cache entries declare the recorded KV heads and head size (the runtime allocates by them)."""
    for entry in graph["inputs"] + graph["outputs"]:
        cache, shape = parse_cache_name(entry["name"]), entry.get("shape")
        if cache is None or not isinstance(shape, list) or len(shape) != 4:
            continue
        heads, head_dim = head.layer_shape(0)
        if (is_int(shape[1]) and shape[1] != heads) or (is_int(shape[3]) and shape[3] != head_dim):
            raise ManifestError(f"{path}: draft.kv_cache is {heads} heads of {head_dim}, but the {DRAFT} graph's "
                                f"{entry['name']} has shape {shape}; the manifest was modified: re-run the export")


def _check_eagle3(record: dict[str, Any], manifest: dict[str, Any], path: Path, num_layers: int) -> int:
    """eagle3's own fields; its vocabulary (Vd)."""
    ids = record.get("aux_layer_ids")
    if not isinstance(ids, list) or not ids or not all(is_int(i) and 0 <= i < num_layers for i in ids) \
            or ids != sorted(set(ids)):
        raise ManifestError(f"{path}: draft.aux_layer_ids is {ids!r:.80}, not distinct ascending layer indices below "
                            f"{num_layers}; re-run the export")
    hidden = manifest["model"].get("hidden_size")
    if record["target_hidden_size"] != len(ids) * hidden:
        raise ManifestError(f"{path}: draft.target_hidden_size {record['target_hidden_size']} is not "
                            f"{len(ids)} aux layers x hidden size {hidden}; re-run the export")
    vocab = _width(record, "draft_vocab_size", path, manifest["model"]["vocab_size"])
    if record.get("format") not in ("speculators", "eagle") or not isinstance(record.get("norm_before_residual"), bool):
        raise ManifestError(f"{path}: draft.format must be speculators or eagle and draft.norm_before_residual a "
                            "boolean; re-run the export")
    return vocab


def check_draft(manifest: dict[str, Any], path: Path, layout: KVLayout) -> KVLayout:
    """ManifestError unless the "draft" record and graphs.draft are whole and agree (module docstring); the head's
    KV layout."""
    record, graph = manifest["draft"], manifest["graphs"].get(DRAFT)
    if not isinstance(record, dict) or not isinstance(graph, dict) or record.get("file") not in manifest["files"] \
            or graph.get("file") != record.get("file"):
        raise ManifestError(f"{path}: a draft record needs an object with a listed file, and the {DRAFT!r} graph of "
                            "that file; re-run the export")
    if record.get("kind") not in DRAFT_KINDS:
        raise ManifestError(f"{path}: draft.kind is {record.get('kind')!r}, not one of {', '.join(DRAFT_KINDS)}; "
                            "re-run the export")
    try:
        head = KVLayout.from_manifest({"kv_cache": record.get("kv_cache")})
    except ManifestError as err:
        raise ManifestError(f"{path}: draft.{err}") from None
    if head.max_capacity > layout.max_capacity:
        raise ManifestError(f"{path}: draft.kv_cache.max_capacity {head.max_capacity} is beyond the target's "
                            f"{layout.max_capacity}; re-run the export")
    if record.get("lm_head_bits") not in (None, 4, 8) or \
            ("lm_head_bits" in record and not is_int(record.get("lm_head_block_size"))):
        raise ManifestError(f"{path}: draft.lm_head_bits is {record.get('lm_head_bits')!r}, not 4 or 8 with an "
                            "integer lm_head_block_size; re-run the export")
    hidden = _width(record, "hidden_size", path)
    target_hidden = _width(record, "target_hidden_size", path)
    vocab = _check_eagle3(record, manifest, path, layout.num_layers) if record["kind"] == "eagle3" \
        else manifest["model"]["vocab_size"]
    GraphIO.draft(head).check(_names(graph, "inputs", path), _names(graph, "outputs", path), str(path))
    _last_dims(manifest, DRAFT, {TARGET_HIDDEN: target_hidden, DRAFT_HIDDEN: hidden, HIDDEN_OUT: hidden, LOGITS: vocab,
                                 TOKEN_MAP: vocab}, path)
    _cache_shapes(graph, head, path)
    for phase in PHASES:
        _last_dims(manifest, phase, {TARGET_HIDDEN: target_hidden}, path)
    return head
