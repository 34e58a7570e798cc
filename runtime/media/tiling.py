"""A tiled family's image made into vision.onnx's input and the prompt's run of ids (the manifest's `vision` record
with `input: "tiles"`, exporter/vision.py): the family's tiling (its processor ported, tiles_*.py) gives the tiles
and the text its Processor writes for the image; the text becomes ids with one image token per feature row.

TILINGS names each tiling by the record's `tiling`; PACKS a family's arrangement of its tiles' feature rows (the
record's `pack`), where the vision graph's rows are not yet the prompt's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvforge.core.errors import InputError, ManifestError
from kvforge.runtime.media.llava_next_pack import llava_onevision_image, pack_llava_next, pack_llava_onevision
from kvforge.runtime.media.tile_ops import TiledImage
from kvforge.runtime.media.tiles_got_ocr2 import aya_vision_image, internvl_image
from kvforge.runtime.media.tiles_idefics3 import idefics3_image
from kvforge.runtime.media.tiles_llava_next import llava_next_image

TILINGS: dict[str, Callable[[Any, dict[str, Any], dict[str, Any]], TiledImage]] = {
    "internvl": internvl_image,
    "aya_vision": aya_vision_image,
    "idefics3": idefics3_image,
    "llava_next": llava_next_image, "llava_onevision": llava_onevision_image,
}
PACKS: dict[str, Callable[[np.ndarray, TiledImage, dict[str, Any], list[np.ndarray]], np.ndarray]] = {
    "llava_next": pack_llava_next, "llava_onevision": pack_llava_onevision,
}
MAX_TILES = 64  # the most tiles one image may give (released processors: 6..13)
# Tilings whose image is made otherwise when its prompt holds several images (LLaVA-OneVision: each is one tile,
# padded to a square, as LlavaOnevisionProcessor's batch_num_images says): they take whole=True then.
SEVERAL = frozenset({"llava_onevision"})


def tile_image(image: Any, vision: dict[str, Any], several: bool = False) -> TiledImage:
    """The image's tiles and text by the record's tiling (several: its prompt holds more images than this one); an
    InputError for an image the tiling cannot take."""
    whole = {"whole": True} if several and vision["tiling"] in SEVERAL else {}
    tiled = TILINGS[vision["tiling"]](image, vision["processor"], vision["prompt"], **whole)
    if not 0 < len(tiled.tiles) <= MAX_TILES:
        raise InputError(f"an image gave {len(tiled.tiles)} tiles; kvforge takes 1..{MAX_TILES} an image")
    return tiled


def pack_features(features: np.ndarray, extras: list[np.ndarray], tiled: TiledImage,
                  vision: dict[str, Any]) -> np.ndarray:
    """The vision graph's rows for the image's tiles as the prompt takes them (the family's pack, if any)."""
    pack = vision.get("pack")
    return PACKS[pack](features, tiled, vision, extras) if pack else features


def image_run(text: str, vision: dict[str, Any], encode: Callable[[str, bool], list[int]], rows: int) -> list[int]:
    """The ids of the text a Processor writes for one image: the text between image tokens tokenized piece by piece
    (the image token is a special token, so it splits the text the same way), one image_token_id for each image
    token. ManifestError unless that is `rows` image tokens (the image's feature rows)."""
    token, token_id = vision["prompt"]["image_token"], vision["image_token_id"]
    pieces = text.split(token)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            ids.append(token_id)
        if piece:
            ids.extend(encode(piece, False))
    if len(pieces) - 1 != rows:
        raise ManifestError(f"an image's text holds {len(pieces) - 1} image tokens for its {rows} feature rows: the "
                            "export's vision.prompt does not fit its vision graph; re-run the export")
    return ids
