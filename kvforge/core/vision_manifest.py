"""A vision-language export's manifest `vision` record (exporter/vision.py) and its graph, checked as kvforge.json's
other sections are (kvforge/core/manifest.py): types, bounds and the graph's IO, before anything is allocated by it.

Three kinds of tower: one fixed-size image in ([1, C, H, W], `tokens_per_image` tokens out); images at their own
size (`input: "patches"`, Qwen2-VL's: patches in with the arrays `tower_inputs` names, tokens by the image's size;
its prompts carry multimodal positions, `positions: "mrope"`, from the `mrope` record's fields); or an image's tiles
as one batch (`input: "tiles"`, InternVL's: the runtime's `tiling` cuts them and writes the image's text from the
`prompt` record, `tokens_per_tile` rows a tile, the graph's `extra_outputs` for its `pack`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.contract import VISION, VISION_EXTRA_OUTPUTS, GraphIO
from kvforge.core.errors import ManifestError
from kvforge.core.model_spec import is_int

# The arrays a patch tower takes beside pixel_values (models/families/qwen_vl_tower.py names them as transformers'
# helpers do).
TOWER_ARRAYS = ("position_ids", "cu_seqlens", "window_index", "cu_window_seqlens", "interp_indices", "interp_weights")
_MROPE_INTS = ("image_token_id", "video_token_id", "spatial_merge_size", "patch_size")


def _names(graph: dict[str, Any], kind: str) -> list[str]:
    return [entry["name"] for entry in graph[kind]]


# The vision record's integer fields and the largest value each may take (the runtime allocates by them).
_VISION_INTS = {"image_token_id": None, "tokens_per_image": 1 << 16, "hidden_size": 1 << 20, "channels": 4}


def check_vision_manifest(manifest: dict[str, Any], path: Path, vocab_size: int) -> None:
    """A vision-language export's `vision` record (exporter/vision.py) and its graph, checked like the others."""
    vision, graph = manifest["vision"], manifest["graphs"].get(VISION)
    if not isinstance(vision, dict) or not isinstance(graph, dict) or graph.get("file") not in manifest["files"]:
        raise ManifestError(f"{path}: a vision record needs an object and a listed {VISION!r} graph; re-run the export")
    for kind in ("inputs", "outputs"):
        if not isinstance(graph.get(kind), list) or not all(isinstance(e, dict) for e in graph[kind]):
            raise ManifestError(f"{path}: graphs.{VISION}.{kind} must be a list of {{'name': ...}}; re-run the export")
    patches, tiled = vision.get("input") == "patches", vision.get("input") == "tiles"
    if vision.get("input") not in (None, "patches", "tiles"):
        raise ManifestError(f"{path}: vision.input is {str(vision.get('input'))[:40]!r}, not \"patches\", \"tiles\" "
                            "or absent; re-run the export")
    tower = _tower_inputs(vision, path) if patches else ()
    extras = _tiles_fields(vision, path) if tiled else ()
    GraphIO.vision(tower, extras).check(_names(graph, "inputs"), _names(graph, "outputs"), str(path))
    for field, most in _VISION_INTS.items():
        if (patches and field in ("tokens_per_image", "channels")) or (tiled and field == "tokens_per_image"):
            continue  # tokens by each image's size or tiles; a patch tower's channels are in its patches
        value = vision.get(field)
        top = vocab_size - 1 if most is None else most
        if not is_int(value) or not 0 <= value <= top or (field != "image_token_id" and value == 0):
            raise ManifestError(f"{path}: vision.{field} is {value!r}, not an integer in 1..{top}; re-run the export")
    size = vision.get("image_size")
    if not patches and not (tiled and size is None) and not (isinstance(size, list) and len(size) == 2
                            and all(is_int(v) and 0 < v <= 1 << 14 for v in size)):
        raise ManifestError(f"{path}: vision.image_size is {size!r}, not [height, width]; re-run the export")
    if vision.get("positions") not in (None, "mrope") or (vision.get("positions") == "mrope") != patches:
        raise ManifestError(f"{path}: vision.positions is {vision.get('positions')!r}: \"mrope\" with a patch tower "
                            "(vision.input \"patches\"), absent otherwise; re-run the export")
    for field in ("before_ids", "after_ids"):
        ids = vision.get(field)
        if not isinstance(ids, list) or not all(is_int(i) and 0 <= i < vocab_size for i in ids):
            raise ManifestError(f"{path}: vision.{field} must be a list of token ids below {vocab_size}; re-run the "
                                "export")
    if not isinstance(vision.get("processor"), dict) or not isinstance(vision.get("placeholder"), str) \
            or not vision["placeholder"]:
        raise ManifestError(f"{path}: vision.processor must be an object and vision.placeholder a text; re-run the "
                            "export")
    chat, prefix = vision.get("chat_placeholder"), vision.get("prompt_prefix")  # absent in older exports
    if chat is not None and (not isinstance(chat, str) or not chat):
        raise ManifestError(f"{path}: vision.chat_placeholder must be a text; re-run the export")
    if any(vision.get(k) is not None and (not isinstance(vision[k], str) or len(vision[k]) > 64)
           for k in ("text_before", "text_after")) or vision.get("image_blocks") not in (None, True, False):
        raise ManifestError(f"{path}: vision.text_before / text_after must be short texts and vision.image_blocks a "
                            "boolean; re-run the export")
    if vision.get("video") is not None and (not patches or not all(
            isinstance(vision.get(k), str) and 0 < len(vision[k]) <= 64 for k in ("video_placeholder",
                                                                                   "video_chat_placeholder"))):
        raise ManifestError(f"{path}: vision.video goes with a patch tower and short video_placeholder / "
                            "video_chat_placeholder texts; re-run the export")
    if prefix is not None and (not isinstance(prefix, str) or len(prefix) > 4096):
        raise ManifestError(f"{path}: vision.prompt_prefix must be a text of at most 4096 characters; re-run the "
                            "export")


def _tiles_fields(vision: dict[str, Any], path: Path) -> tuple[str, ...]:
    """A tiled tower's record (its tiling's name, the Processor's prompt settings, the rows a tile gives) and the
    vision graph's extra outputs, checked."""
    tiling, prompt, extras = vision.get("tiling"), vision.get("prompt"), vision.get("extra_outputs") or []
    if not isinstance(tiling, str) or not isinstance(prompt, dict) or not isinstance(prompt.get("image_token"), str) \
            or not prompt["image_token"]:
        raise ManifestError(f"{path}: a tiled vision record needs vision.tiling (a name) and vision.prompt with an "
                            "image_token text; re-run the export")
    per_tile = vision.get("tokens_per_tile")
    if per_tile is not None and not (is_int(per_tile) and 0 < per_tile <= 1 << 16):
        raise ManifestError(f"{path}: vision.tokens_per_tile is {per_tile!r}, not an integer in 1..65536; re-run the "
                            "export")
    if not isinstance(extras, list) or not all(name in VISION_EXTRA_OUTPUTS for name in extras) \
            or len(set(extras)) != len(extras) or not isinstance(vision.get("pack", ""), str):
        raise ManifestError(f"{path}: vision.extra_outputs is {str(extras)[:80]!r} and vision.pack "
                            f"{str(vision.get('pack'))[:40]!r}: a list of {', '.join(VISION_EXTRA_OUTPUTS)} and a "
                            "name; re-run the export")
    return tuple(extras)


def _tower_inputs(vision: dict[str, Any], path: Path) -> tuple[str, ...]:
    """A patch tower's array names (of TOWER_ARRAYS) and its `mrope` record's sizes, checked."""
    names, record = vision.get("tower_inputs"), vision.get("mrope")
    if not isinstance(names, list) or not all(name in TOWER_ARRAYS for name in names) or len(set(names)) != len(names):
        raise ManifestError(f"{path}: vision.tower_inputs is {str(names)[:80]!r}, not a list of {', '.join(TOWER_ARRAYS)}; "
                            "re-run the export")
    if not isinstance(record, dict) or not all(is_int(record.get(k)) and 0 <= record[k] < 1 << 24 for k in _MROPE_INTS):
        raise ManifestError(f"{path}: vision.mrope must hold the integers {', '.join(_MROPE_INTS)}; re-run the export")
    for key in ("window_size", "num_position_embeddings"):
        if record.get(key) is not None and not (is_int(record[key]) and 0 < record[key] < 1 << 24):
            raise ManifestError(f"{path}: vision.mrope.{key} is {record[key]!r}, not a positive integer; re-run the "
                                "export")
    return tuple(names)
