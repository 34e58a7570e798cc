"""A request's images made into what the engine feeds the prefill graph: each prompt row's image places expanded
(runtime/media/image_prompt.py) and its images read, preprocessed and encoded by vision.onnx, in the order of their
places (contract.IMAGE_FEATURES)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.image_prompt import expand_images, image_key, text_with_images
from kvforge.runtime.media.images import DEFAULT_LIMITS, ImageLimits, LoadedImage, load_image
from kvforge.runtime.media.preprocess import preprocess
from kvforge.runtime.media.video import Video, load_video
from kvforge.runtime.media.vision_record import check_vision_record

# An image's features, its patch grid (a family whose images take tokens by size) and its run of prompt ids (a tiled
# family's).
Made = tuple[np.ndarray, tuple[int, int, int] | None, tuple[int, ...] | None]


@dataclass(frozen=True)
class RowImages:
    """One prompt row's images: their features, image token by image token, and their digests."""

    features: np.ndarray  # [images * tokens_per_image, hidden]
    digests: tuple[str, ...]
    # An M-RoPE export's: the prompt row's positions [3, S] and its later positions' offset (contract.POSITION_IDS,
    # ROPE_DELTAS); None and 0 elsewhere.
    positions: np.ndarray | None = None
    rope_delta: int = 0
    counts: tuple[int, ...] = ()  # each image's token count (its features' rows)

    def attach(self, row: Any) -> None:
        """Give a Row (runtime/drivers/rows.py) its prompt's image features and positions."""
        row.image_features, row.positions, row.rope_delta = self.features, self.positions, self.rope_delta


@dataclass(frozen=True)
class EncodedImage(LoadedImage):
    """An image read, checked and encoded already (the server does it before admission): its features go with it,
    so admission never encodes (and never depends on the kept features' cache)."""

    features: np.ndarray | None = None
    grid: tuple[int, int, int] | None = None  # a family whose images take tokens by size: its (t, h, w) patch grid
    run: tuple[int, ...] | None = None  # a tiled family's: the ids its Processor writes for the image (tiling.py)
    seconds: float | None = None  # a video's: the seconds one temporal patch spans (None: an image)


class Images:
    """A vision-language export's image path: the manifest's `vision` record, its encoder (made on first use) and
    the features of the last images encoded (by digest), so a conversation about one image encodes it once."""

    KEPT = 16

    def __init__(self, folder: Path, manifest: dict[str, Any], bos_token_id: int | None,
                 limits: ImageLimits = DEFAULT_LIMITS, encode: Callable[[str, bool], list[int]] | None = None) -> None:
        self.folder, self.manifest = folder, manifest
        check_vision_record(folder, manifest)  # a crafted record is one line naming its field, here at load
        self.vision = {**manifest["vision"], "bos_token_id": bos_token_id}
        self.limits = limits
        self._text_ids = encode  # (text, special tokens?) -> ids: a tiled image's text (None: no tokenizer)
        self._encoder: Any = None
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, Made] = OrderedDict()

    def encode_rows(self, images: list[list[Any]]) -> list[list[EncodedImage]]:
        """Each row's images read, checked and encoded (their token counts decide their prompt runs)."""
        if any(len(row) > self.limits.max_images for row in images):
            raise InputError(f"too many images: at most {self.limits.max_images} per prompt")
        return [self.encode(row) for row in images]

    def prompt_rows(self, prompts: list[Any], images: list[list[EncodedImage]],
                    encode: Any) -> tuple[list[list[int]], list[list[EncodedImage]]]:
        """Each prompt (text or token ids) with its image places expanded, each to its image's token count; and each
        row's images and videos in the order of their places (images fill the image places in the order given,
        videos the video places)."""
        rows, ordered = [], []
        for i, (prompt, row_images) in enumerate(zip(prompts, images, strict=True)):
            ids = text_with_images(prompt, self.vision, encode) if isinstance(prompt, str) else list(prompt)
            row_images = self._in_place_order(ids, row_images)
            runs = [one.run for one in row_images]
            marks = [self._video_token if one.seconds is not None else self.vision["image_token_id"]
                     for one in row_images]
            rows.append(expand_images(ids, [len(one.features) for one in row_images], self.vision, f"prompt {i}",
                                      runs if any(run is not None for run in runs) else None, marks))
            ordered.append(row_images)
        return rows, ordered

    def _in_place_order(self, ids: list[int], media: list[EncodedImage]) -> list[EncodedImage]:
        """`media` ordered as the image and video places of `ids` take them (as given where the places are fewer or
        the kinds do not add up: expand_images then says what is wrong)."""
        video = self._video_token
        if video is None or not any(one.seconds is not None for one in media):
            return media
        places = [i for i in ids if i in (video, self.vision["image_token_id"])]
        queues = {True: [one for one in media if one.seconds is not None],
                  False: [one for one in media if one.seconds is None]}
        if sum(p == video for p in places) != len(queues[True]) or len(places) != len(media):
            return media
        return [queues[p == video].pop(0) for p in places]

    def row_images(self, rows: list[list[int]], images: list[list[EncodedImage]]) -> list[RowImages | None]:
        """What the engine feeds each row's prefill (None for a row without images): its images' features, and an
        M-RoPE export's positions."""
        out: list[RowImages | None] = []
        for ids, encoded in zip(rows, images, strict=True):
            if not encoded:
                out.append(None)
                continue
            positions, delta = self._positions(ids, encoded)
            out.append(RowImages(np.concatenate([one.features for one in encoded]),
                                 tuple(one.digest for one in encoded), positions, delta,
                                 tuple(len(one.features) for one in encoded)))
        return out

    def _positions(self, ids: list[int], encoded: list[EncodedImage]) -> tuple[np.ndarray | None, int]:
        """An M-RoPE export's prompt positions [3, S] and rope delta (runtime/media/mrope.py); (None, 0) elsewhere."""
        if self.vision.get("positions") != "mrope":
            return None, 0
        from kvforge.runtime.media.mrope import OPTIONS, mrope_positions

        record = self.vision["mrope"]
        seconds = [one.seconds for one in encoded if one.seconds is not None]
        if seconds:  # a video's tokens are image tokens to the prefill graph, video tokens to the positions
            ids = _video_runs(ids, [one.seconds is not None for one in encoded], record)
        return mrope_positions(ids, [one.grid for one in encoded], image_token_id=record["image_token_id"],
                               video_seconds=seconds or None,
                               video_token_id=record["video_token_id"],
                               spatial_merge_size=record["spatial_merge_size"],
                               **{key: record[key] for key in OPTIONS if record.get(key) is not None})

    def encode(self, sources: list[Any]) -> list[EncodedImage]:
        """Each image read, checked and encoded in turn, with its features. Its decoded pixels are dropped once it is
        encoded (image None): one large image is decoded at a time, and a request waiting in the queue holds its
        features only, not a large image's hundreds of megabytes."""
        from kvforge.runtime.media.tiling import SEVERAL

        # LLaVA-OneVision makes each image of a prompt with several one tile: kept and keyed apart from it alone
        several = len(sources) > 1 and self.vision.get("tiling") in SEVERAL
        out = []
        for source in sources:
            if isinstance(source, Video):
                out.append(self._video(source))
                continue
            one = load_image(source, self.limits)
            if several and not isinstance(one, EncodedImage):  # a digest of its own (the prefix key reads its head)
                one = dataclasses.replace(one, digest=hashlib.sha256(f"{one.digest}/several".encode()).hexdigest())
            out.append(one if isinstance(one, EncodedImage) else
                       EncodedImage(None, one.digest, *self._features(one, several)))
            del one  # the decoded pixels go before the next image is decoded
        return out

    @property
    def _video_token(self) -> int | None:
        return self.vision["mrope"]["video_token_id"] if self.vision.get("video") is not None else None

    def _video(self, video: Video) -> EncodedImage:
        """A video's frames (Qwen2-VL's, Qwen2.5-VL's) as its video processor makes them, through the tower as one
        patch sequence; its run: the family's ids around it and one image token per feature row (the prefill graph
        writes features at image tokens; the positions take them as the video's, _video_runs)."""
        from kvforge.runtime.media.mrope import tower_inputs
        from kvforge.runtime.media.qwen_vl_preprocess import preprocess_qwen_video

        if self._video_token is None:
            raise InputError(f"{self.folder} takes no videos (its vision record has no video processor); send "
                             "images")
        loaded = load_video(video, self.limits)
        record, settings = self.vision["mrope"], self.vision["video"]
        with self._lock:
            if self._encoder is None:
                from kvforge.runtime.backends.vision_encoder import PatchEncoder

                self._encoder = PatchEncoder(self.folder, self.manifest)
            pixels, grid = preprocess_qwen_video(loaded.frames, settings)
            merge = record["spatial_merge_size"]
            arrays = tower_inputs([grid], merge, record.get("window_size"), record.get("patch_size"),
                                  record.get("num_position_embeddings"))
            features = self._encoder.encode(pixels, arrays, grid[0] * grid[1] * grid[2] // merge**2)
        v = self.vision
        run = (*v["before_ids"], *[v["image_token_id"]] * len(features), *v["after_ids"])
        return EncodedImage(None, loaded.digest, features, grid, run, settings["temporal_patch_size"] / loaded.fps)

    def prompt_length(self, ids: list[int], images: list[Any]) -> int:
        """The length of a prompt whose image places (one id each among `ids`) are expanded: each image's run is
        before_ids, its image tokens (an encoded image's feature rows; tokens_per_image for one not yet encoded)
        and after_ids."""
        v = self.vision
        around = len(v["before_ids"]) + len(v["after_ids"]) - 1
        return len(ids) + sum(len(one.run) - 1 if getattr(one, "run", None) is not None else
                              around + (len(one.features) if getattr(one, "features", None) is not None
                                        else v["tokens_per_image"] or 1) for one in images)

    def key(self, ids: list[int], row: RowImages | None) -> list[int]:
        """A prompt row's prefix-cache key (image tokens keyed by their image)."""
        return ids if row is None else image_key(ids, list(row.digests), self.vision, row.counts)

    @property
    def tiled(self) -> bool:
        """Whether the export's images are tiled (runtime/media/tiling.py)."""
        return self.vision.get("input") == "tiles"

    def _features(self, loaded: Any, several: bool = False) -> Made:
        """An image's features (kept by digest); for a family whose images take tokens by size, its grid; for a tiled
        family, its run of prompt ids."""
        with self._lock:
            kept = self._kept.get(loaded.digest)
            if kept is not None:
                self._kept.move_to_end(loaded.digest)
                return kept
            patches = self.vision.get("input") == "patches"  # a tower of images at their own size
            if self._encoder is None:
                from kvforge.runtime.backends.vision_encoder import PatchEncoder, TileEncoder, VisionEncoder

                kind = PatchEncoder if patches else TileEncoder if self.tiled else VisionEncoder
                self._encoder = kind(self.folder, self.manifest)
            if patches:
                made: Made = (*self._patch_features(loaded.image), None)
            elif self.tiled:
                made = self._tile_features(loaded.image, several)
            else:
                made = (self._encoder.encode(preprocess(loaded.image, self.vision["processor"])), None, None)
            self._kept[loaded.digest] = made
            if len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
            return made

    def _tile_features(self, image: Any, several: bool = False) -> Made:
        """A tiled family's image: its tiles through vision.onnx as one batch, the rows arranged as its prompt takes
        them, and the ids its Processor writes for it."""
        from kvforge.runtime.media.tiling import image_run, pack_features, tile_image

        if self._text_ids is None:
            raise InputError(f"{self.folder} has no tokenizer.json, which a tiled image's text needs (its Processor "
                             "writes each tile's tokens); add the checkpoint's tokenizer to the export folder")
        tiled = tile_image(image, self.vision, several)
        features, extras = self._encoder.encode(np.stack(tiled.tiles))
        features = pack_features(features, extras, tiled, self.vision)
        return features, None, tuple(image_run(tiled.text, self.vision, self._text_ids, len(features)))

    def _patch_features(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A tower of images at their own size (Qwen-VL's): the image's patches and grid, the tower's other inputs
        from the grid, its features."""
        from kvforge.runtime.media.mrope import tower_inputs
        from kvforge.runtime.media.qwen_vl_preprocess import preprocess_qwen

        pixels, grid = preprocess_qwen(image, self.vision["processor"])
        record = self.vision["mrope"]
        merge = record["spatial_merge_size"]
        arrays = tower_inputs([grid], merge, record.get("window_size"), record.get("patch_size"),
                              record.get("num_position_embeddings"))
        return self._encoder.encode(pixels, arrays, grid[0] * grid[1] * grid[2] // merge**2), grid


def _video_runs(ids: list[int], videos: list[bool], record: dict[str, Any]) -> list[int]:
    """`ids` with the image tokens of each video's run made video tokens (the k-th run of image tokens is the k-th
    image or video), as transformers' positions see them."""
    out, run, inside = list(ids), -1, False
    for i, token in enumerate(ids):
        if token == record["image_token_id"]:
            run += 0 if inside else 1
            inside = True
            if videos[run]:
                out[i] = record["video_token_id"]
        else:
            inside = False
    return out
