"""A video a caller hands the runtime: its frames, already sampled (a list of images, a folder of image files, or a
uint8 array [frames, H, W, 3]), and the rate they were sampled at. Each frame is read and checked as an image is
(runtime/media/images.py), and the frame count against the limit, before anything is decoded past the limit.

Videos are taken by the families whose towers take frames (Qwen2-VL, Qwen2.5-VL: the manifest's vision.video
record, their video processor's settings); a prompt marks a video's place with "<video>", as an image's with
"<image>". Decoding a video file (mp4, ...) is left to the caller: OpenAI's API has no video part, so the server
takes a frame list (docs/vision.md says the format).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.images import DEFAULT_LIMITS, ImageLimits, load_image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
DEFAULT_FPS = 2.0  # the rate Qwen2.5-VL's processor assumes for frames given without one


@dataclass(frozen=True)
class Video:
    """A video's frames (each what load_image takes, or one uint8 array [frames, H, W, 3]) and the rate they were
    sampled at, in frames per second (None: DEFAULT_FPS, as transformers' Qwen processors assume)."""

    frames: Any
    fps: float | None = None


@dataclass(frozen=True)
class LoadedVideo:
    """A video's decoded frames (PIL images of one size), its rate and the sha256 of its frames' digests and rate."""

    frames: list[Any]
    fps: float
    digest: str


def video_from_path(path: Path | str, fps: float | None = None) -> Video:
    """A folder of frame images (in name order) or one frame file as a Video; an InputError naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())
        if not files:
            raise InputError(f"video folder {path} holds no frame images ({', '.join(FRAME_SUFFIXES)})")
        return Video(tuple(files), fps)
    if not path.is_file():
        raise InputError(f"video {path} is neither a folder of frames nor a file")
    return Video((path,), fps)


def load_video(video: Video, limits: ImageLimits = DEFAULT_LIMITS) -> LoadedVideo:
    """The video's frames read and checked (each as an image; their count against limits.max_frames; one size)."""
    fps = DEFAULT_FPS if video.fps is None else video.fps
    if not isinstance(fps, int | float) or isinstance(fps, bool) or not 0 < fps <= 1000:
        raise InputError(f"a video's fps is {video.fps!r}; give a rate in (0, 1000] frames a second")
    frames = video.frames
    count = len(frames) if isinstance(frames, list | tuple | np.ndarray) else None
    if count is None:
        raise InputError(f"a video's frames must be a list of images or a uint8 array, got {type(frames).__name__}")
    if not 0 < count <= limits.max_frames:
        raise InputError(f"a video of {count} frames: kvforge takes 1..{limits.max_frames} frames a video; sample "
                         "fewer frames")
    if isinstance(frames, np.ndarray):
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise InputError(f"video frames must be uint8 [frames, height, width, 3], not {frames.dtype} "
                             f"{list(frames.shape)}")
        frames = list(frames)
    images, digest = [], hashlib.sha256(repr(float(fps)).encode())
    for frame in frames:
        one = load_image(frame, limits)
        images.append(one.image)
        digest.update(one.digest.encode())
    if len({image.size for image in images}) != 1:
        raise InputError(f"a video's frames differ in size ({sorted({image.size for image in images})}); send frames "
                         "of one size")
    return LoadedVideo(images, float(fps), digest.hexdigest())
