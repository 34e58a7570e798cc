"""A request's images made into what the engine feeds the prefill graph: each prompt row's image places expanded
(runtime/media/image_prompt.py) and its images read, preprocessed and encoded by vision.onnx, in the order of their
places (contract.IMAGE_FEATURES)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.image_prompt import expand_images, image_key, text_with_images
from kvforge.runtime.media.images import DEFAULT_LIMITS, ImageLimits, LoadedImage, load_image
from kvforge.runtime.media.preprocess import preprocess
from kvforge.runtime.media.vision_record import check_vision_record


@dataclass(frozen=True)
class RowImages:
    """One prompt row's images: their features, image token by image token, and their digests."""

    features: np.ndarray  # [images * tokens_per_image, hidden]
    digests: tuple[str, ...]


@dataclass(frozen=True)
class EncodedImage(LoadedImage):
    """An image read, checked and encoded already (the server does it before admission): its features go with it,
    so admission never encodes (and never depends on the kept features' cache)."""

    features: np.ndarray | None = None


class Images:
    """A vision-language export's image path: the manifest's `vision` record, its encoder (made on first use) and
    the features of the last images encoded (by digest), so a conversation about one image encodes it once."""

    KEPT = 16

    def __init__(self, folder: Path, manifest: dict[str, Any], bos_token_id: int | None,
                 limits: ImageLimits = DEFAULT_LIMITS) -> None:
        self.folder, self.manifest = folder, manifest
        check_vision_record(folder, manifest)  # a crafted record is one line naming its field, here at load
        self.vision = {**manifest["vision"], "bos_token_id": bos_token_id}
        self.limits = limits
        self._encoder: Any = None
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, np.ndarray] = OrderedDict()

    def prompt_rows(self, prompts: list[Any], images: list[list[Any]], encode: Any) -> list[list[int]]:
        """Each prompt (text or token ids) with its image places expanded."""
        rows = []
        for i, (prompt, row_images) in enumerate(zip(prompts, images, strict=True)):
            ids = text_with_images(prompt, self.vision, encode) if isinstance(prompt, str) else list(prompt)
            rows.append(expand_images(ids, len(row_images), self.vision, f"prompt {i}"))
        return rows

    def encode_rows(self, images: list[list[Any]]) -> list[RowImages | None]:
        """The features of each row's images (None for a row without)."""
        if any(len(row) > self.limits.max_images for row in images):
            raise InputError(f"too many images: at most {self.limits.max_images} per prompt")
        out: list[RowImages | None] = []
        for row in images:
            encoded = self.encode(row)
            out.append(RowImages(np.concatenate([one.features for one in encoded]),
                                 tuple(one.digest for one in encoded)) if encoded else None)
        return out

    def encode(self, sources: list[Any]) -> list[EncodedImage]:
        """Each image read, checked and encoded in turn, with its features. Its decoded pixels are dropped once it is
        encoded (image None): one large image is decoded at a time, and a request waiting in the queue holds its
        features only, not a large image's hundreds of megabytes."""
        out = []
        for source in sources:
            one = load_image(source, self.limits)
            out.append(one if isinstance(one, EncodedImage) else EncodedImage(None, one.digest, self._features(one)))
            del one  # the decoded pixels go before the next image is decoded
        return out

    def run_length(self) -> int:
        """The tokens one image takes in a prompt (its run: before_ids, its image tokens, after_ids)."""
        v = self.vision
        return len(v["before_ids"]) + v["tokens_per_image"] + len(v["after_ids"])

    def key(self, ids: list[int], row: RowImages | None) -> list[int]:
        """A prompt row's prefix-cache key (image tokens keyed by their image)."""
        return ids if row is None else image_key(ids, list(row.digests), self.vision)

    def _features(self, loaded: Any) -> np.ndarray:
        with self._lock:
            kept = self._kept.get(loaded.digest)
            if kept is not None:
                self._kept.move_to_end(loaded.digest)
                return kept
            if self._encoder is None:
                from kvforge.runtime.backends.vision_encoder import VisionEncoder

                self._encoder = VisionEncoder(self.folder, self.manifest)
            features = self._encoder.encode(preprocess(loaded.image, self.vision["processor"]))
            self._kept[loaded.digest] = features
            if len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
            return features
