"""What the vision-language tests share: a seeded random RGB picture, and a transformers Processor class that takes
no video processor (transformers' video processors need torchvision, which is not installed here)."""

from __future__ import annotations

from typing import Any

import numpy as np


def rgb_image(seed: int, height: int, width: int) -> Any:
    """A PIL RGB image of seeded noise."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8), "RGB")


def no_videos(cls: type) -> type:
    """`cls` (a Processor class) taking no video processor."""
    class NoVideos(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return NoVideos
