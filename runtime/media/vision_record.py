"""A vision-language export's manifest `vision` record checked at load against the graphs' declared IO and sane
bounds, so a crafted or damaged record is one ManifestError naming its field, before anything is allocated by it
(kvforge/core/manifest.py has checked its types and its ids against the vocabulary already). The vision graph's own
IO is checked against the record when its session is made (runtime/backends/vision_encoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.contract import IMAGE_FEATURES, PIXEL_VALUES, VISION
from kvforge.core.errors import InputError, ManifestError
from kvforge.core.manifest import io_entry

MAX_SIDE = 4096  # the largest image side a vision graph may take (released towers take 224..1024)
MAX_FEATURES = 1 << 26  # tokens_per_image x hidden_size: 256 MiB of float32 features per image at most
_FLAGS = ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_pad", "crop_to_patches",
          "do_pan_and_scan")
_SIZE_KEYS = ("shortest_edge", "longest_edge", "height", "width")


def check_vision_record(folder: Path, manifest: dict[str, Any]) -> None:
    """ManifestError (naming the field) unless the record agrees with the vision graph's declared pixel_values
    [1, channels, height, width] and image_features [tokens_per_image, hidden_size], the prefill graph's
    image_features [*, hidden_size], and its processor makes images of image_size."""
    vision, where = manifest["vision"], f"{folder}/kvforge.json"
    if vision.get("input") == "patches":
        _check_patch_record(manifest, vision, where)
        return
    if vision.get("input") == "tiles":
        _check_tiled_record(manifest, vision, where)
        return
    height, width = vision["image_size"]
    if max(height, width) > MAX_SIDE:
        raise ManifestError(f"{where}: vision.image_size {vision['image_size']} is over {MAX_SIDE} pixels a side; "
                            "re-run the export")
    if vision["tokens_per_image"] * vision["hidden_size"] > MAX_FEATURES:
        raise ManifestError(f"{where}: vision.tokens_per_image x vision.hidden_size is over {MAX_FEATURES} features "
                            "an image; re-run the export")
    wanted = [(VISION, PIXEL_VALUES, [1, vision["channels"], height, width], ("channels", "image_size")),
              (VISION, IMAGE_FEATURES, [vision["tokens_per_image"], vision["hidden_size"]],
               ("tokens_per_image", "hidden_size")),
              ("prefill", IMAGE_FEATURES, [None, vision["hidden_size"]], ("hidden_size",))]
    for phase, name, want, fields in wanted:
        entry = io_entry(manifest, phase, name)
        shape = entry.get("shape") if entry is not None else None
        if not isinstance(shape, list) or len(shape) != len(want) or any(
                w is not None and isinstance(d, int) and d != w for d, w in zip(shape, want, strict=True)):
            raise ManifestError(f"{where}: vision.{' and vision.'.join(fields)} say {name} {want} in the {phase} "
                                f"graph, which declares {shape}; the manifest was modified: re-run the export")
    check_processor_record(vision, where)


def _check_patch_record(manifest: dict[str, Any], vision: dict[str, Any], where: str) -> None:
    """A tower of images at their own size (Qwen2-VL's): the prefill graph's image_features [*, hidden_size] and its
    processor record (runtime/media/qwen_vl_preprocess.py)."""
    from kvforge.runtime.media.qwen_vl_preprocess import check_qwen_record

    entry = io_entry(manifest, "prefill", IMAGE_FEATURES)
    shape = entry.get("shape") if entry is not None else None
    if not isinstance(shape, list) or len(shape) != 2 or (isinstance(shape[1], int) and shape[1] != vision["hidden_size"]):
        raise ManifestError(f"{where}: vision.hidden_size says {IMAGE_FEATURES} [*, {vision['hidden_size']}] in the "
                            f"prefill graph, which declares {shape}; the manifest was modified: re-run the export")
    for field in ("processor", "video"):
        if field == "video" and vision.get("video") is None:
            continue
        try:
            if not isinstance(vision[field], dict):
                raise InputError("not an object")
            check_qwen_record(vision[field])
        except InputError as err:
            raise ManifestError(f"{where}: vision.{field}: {err}") from None


def _check_tiled_record(manifest: dict[str, Any], vision: dict[str, Any], where: str) -> None:
    """A tiled tower's record (runtime/media/tiling.py): a tiling this runtime has, the prefill graph's
    image_features [*, hidden_size], and the tiling applied to a small image: tiles of image_size, the image's text
    holding its image tokens."""
    from PIL import Image

    from kvforge.runtime.media.tiling import PACKS, TILINGS, tile_image

    if vision["tiling"] not in TILINGS or (vision.get("pack") and vision["pack"] not in PACKS):
        raise ManifestError(f"{where}: vision.tiling {str(vision['tiling'])[:40]!r} (pack {vision.get('pack')!r}) is "
                            f"not one this kvforge has ({', '.join(TILINGS)}); re-run the export with this version")
    entry = io_entry(manifest, "prefill", IMAGE_FEATURES)
    shape = entry.get("shape") if entry is not None else None
    if not isinstance(shape, list) or len(shape) != 2 or (isinstance(shape[1], int) and shape[1] != vision["hidden_size"]):
        raise ManifestError(f"{where}: vision.hidden_size says {IMAGE_FEATURES} [*, {vision['hidden_size']}] in the "
                            f"prefill graph, which declares {shape}; the manifest was modified: re-run the export")
    try:
        tiled = tile_image(Image.new("RGB", (8, 8)), vision)
    except (InputError, ValueError, TypeError, KeyError) as err:
        raise ManifestError(f"{where}: vision.processor and vision.prompt cannot be applied ({type(err).__name__}: "
                            f"{err}); re-run the export") from None
    size = vision.get("image_size")
    if size is not None and any(tuple(tile.shape) != (vision["channels"], *size) for tile in tiled.tiles):
        raise ManifestError(f"{where}: vision.processor makes tiles of shape {list(tiled.tiles[0].shape)}, but "
                            f"vision.channels and vision.image_size say {[vision['channels'], *size]}; re-run the export")
    if tiled.text.count(vision["prompt"]["image_token"]) != tiled.image_tokens:
        raise ManifestError(f"{where}: vision.prompt.image_token is not the token its tiling writes for an image's "
                            "features; re-run the export")


def check_processor_record(vision: dict[str, Any], where: str) -> None:
    """The processor record's fields (types and bounds), then its output on a small image: of image_size."""
    from kvforge.runtime.media.preprocess import check_processor

    record, channels = vision["processor"], vision["channels"]
    bound = 2 * max(vision["image_size"])
    for flag in _FLAGS:
        _field(where, record, flag, record.get(flag) in (None, True, False), "true, false or null")
    for key in ("size", "crop_size"):
        value = record.get(key)
        _field(where, record, key, value is None or (isinstance(value, dict) and set(value) <= set(_SIZE_KEYS) and all(
            _int(v) and 0 < v <= bound for v in value.values())), f"an object of sizes in 1..{bound}")
    _field(where, record, "resample", record.get("resample") is None or record["resample"] in range(6),
           "a PIL resampling filter 0..5")
    _field(where, record, "min_size", record.get("min_size") is None or (_int(record["min_size"])
                                                                         and 0 <= record["min_size"] <= bound),
           f"an integer in 0..{bound}")
    _field(where, record, "rescale_factor", not record.get("do_rescale") or _number(record.get("rescale_factor")),
           "a number")
    for key in ("image_mean", "image_std"):
        value = record.get(key)
        values = value if isinstance(value, list) and len(value) == channels else [value]
        _field(where, record, key, not record.get("do_normalize") or all(
            _number(v) and (key == "image_mean" or v != 0) for v in values), f"a number or {channels} numbers")
    color = record.get("background_color")
    _field(where, record, "background_color", color is None or all(_number(v) and 0 <= v <= 255 for v in (
        color if isinstance(color, list) and len(color) <= channels else [color])), "colour values 0..255")
    try:
        check_processor(record)
    except InputError as err:
        raise ManifestError(f"{where}: vision.processor: {err}") from None
    _check_output_size(vision, where)


def _check_output_size(vision: dict[str, Any], where: str) -> None:
    """The processor's output on a small square image (cheap: every size is bounded above) is
    [channels, *image_size]."""
    from PIL import Image

    from kvforge.runtime.media.preprocess import preprocess

    try:
        shape = preprocess(Image.new("RGB", (4, 4)), vision["processor"]).shape
    except (InputError, ValueError, TypeError, KeyError) as err:
        raise ManifestError(f"{where}: vision.processor cannot be applied ({type(err).__name__}: {err}); re-run the "
                            "export") from None
    if tuple(shape) != (vision["channels"], *vision["image_size"]):
        raise ManifestError(f"{where}: vision.processor makes images of shape {list(shape)}, but vision.channels and "
                            f"vision.image_size say {[vision['channels'], *vision['image_size']]}; re-run the export")


def _field(where: str, record: dict[str, Any], key: str, ok: bool, what: str) -> None:
    if not ok:
        raise ManifestError(f"{where}: vision.processor.{key} is {str(record.get(key))[:60]!r}, not {what}; re-run "
                            "the export")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value and abs(value) < 1e30
