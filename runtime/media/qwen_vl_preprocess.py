"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision inputs made with numpy and Pillow, as transformers 5.24 makes them:
`pixel_values` [patches, C * temporal_patch_size * patch_size**2] float32 and the grid (t, h, w) in patches.

Images: Qwen2VLImageProcessor (Qwen2.5-VL and Qwen3-VL use the same class; Qwen3-VL's checkpoints set patch_size 16
and mean/std 0.5). Its PIL backend ("pil") resizes with Pillow and rescales in float64 then normalises in float32
(preprocess.py's steps); its torchvision backend ("torchvision") resizes with torch's uint8 bicubic
(antialias_resize.py) and normalises with mean and std pre-multiplied by 1/rescale_factor, in float32.
Videos: Qwen2VLVideoProcessor / Qwen3VLVideoProcessor (torchvision only), given the frames already sampled;
`sample_frame_indices` is Qwen3-VL's own frame sampling. tests/runtime/test_qwen_vl_inputs.py compares all of it
with transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.runtime.media.antialias_resize import resize_uint8
from kvforge.runtime.media.preprocess import _channels_first, preprocess

IMAGE_CLASSES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil")
VIDEO_CLASSES = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")
MAX_ASPECT = 200  # transformers' smart_resize refuses a longer side over 200 times the shorter
BICUBIC = 3


def check_qwen_record(record: dict[str, Any]) -> None:
    """InputError unless the record is one this module reproduces."""
    if record.get("class") not in IMAGE_CLASSES + VIDEO_CLASSES:
        raise InputError(f"processor {record.get('class')!r} is not a Qwen-VL processor kvforge reproduces "
                         f"({', '.join(IMAGE_CLASSES + VIDEO_CLASSES)})")
    if record.get("backend") not in ("pil", "torchvision"):
        raise InputError(f"processor backend {record.get('backend')!r} is not reproduced (pil or torchvision)")
    if record.get("do_resize") and record.get("backend") == "torchvision" and record.get("resample") != BICUBIC:
        raise InputError(f"a torchvision-backend resize with resample {record.get('resample')!r} is not reproduced "
                         "(only BICUBIC, 3)")
    for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
        if not isinstance(record.get(key), int) or record[key] < 1:
            raise InputError(f"processor record field {key} is {record.get(key)!r}; a positive integer is needed")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: sides multiples of factor, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as it can be. InputError for an aspect ratio over 200, as transformers refuses."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"an image of {width}x{height} pixels has an aspect ratio over {MAX_ASPECT}, which Qwen-VL "
                         "processors refuse; crop it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video3(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                        max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: the pixel budget counts the frames, a side under factor is scaled up first.
    InputError for fewer frames than temporal_patch_size (transformers refuses them) or an aspect ratio over 200."""
    if frames < temporal:
        raise InputError(f"a video of {frames} frame(s) is shorter than the {temporal} frames Qwen3-VL's processor "
                         "needs; send more frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"a video of {width}x{height} pixels has an aspect ratio over {MAX_ASPECT}, which Qwen-VL "
                         "processors refuse; crop it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _patchify(frames: np.ndarray, record: dict[str, Any]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 [F, C, H, W] to [t*h*w, C*T*P*P] in transformers' order (merge blocks of merge x merge patches,
    row-major); F padded to a multiple of temporal_patch_size T by repeating the last frame."""
    patch, merge, temporal = record["patch_size"], record["merge_size"], record["temporal_patch_size"]
    if pad := -frames.shape[0] % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    count, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = count // temporal, height // patch, width // patch
    if grid_h % merge or grid_w % merge or height % patch or width % patch:
        raise InputError(f"a {width}x{height} frame is not a whole number of {merge}x{merge} blocks of "
                         f"{patch}-pixel patches; the processor record needs do_resize")
    patches = frames.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return np.ascontiguousarray(flat, dtype=np.float32), (grid_t, grid_h, grid_w)


def _torch_normalize(frames: np.ndarray, record: dict[str, Any]) -> np.ndarray:
    """uint8 [F, C, H, W] rescaled and normalised as transformers' torchvision backend does: both at once with
    mean and std multiplied by 1/rescale_factor (float32), else each alone, in float32."""
    channels = frames.shape[1]
    rescale, normalize = record.get("do_rescale"), record.get("do_normalize")
    if normalize:
        mean = np.array(_per_channel(record["image_mean"], channels), dtype=np.float32)
        std = np.array(_per_channel(record["image_std"], channels), dtype=np.float32)
        if rescale:
            inverse = np.float32(1.0 / record["rescale_factor"])
            mean, std = mean * inverse, std * inverse
        return (frames.astype(np.float32) - mean[:, None, None]) / std[:, None, None]
    if rescale:
        return frames.astype(np.float32) * np.float32(record["rescale_factor"])
    return frames.astype(np.float32)


def _per_channel(value: Any, channels: int) -> list[float]:
    return list(value) if isinstance(value, list | tuple) else [value] * channels


def preprocess_qwen(image: Any, record: dict[str, Any]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values float32 [h*w, C*T*P*P], grid (1, h, w)): a PIL image as the image processor of `record`
    makes it (the image repeated temporal_patch_size times in each patch)."""
    check_qwen_record(record)
    width, height = image.size
    if not width or not height:
        raise InputError("an image with no pixels was sent")
    factor = record["patch_size"] * record["merge_size"]
    if record.get("do_resize"):
        height, width = smart_resize(height, width, factor, record["min_pixels"], record["max_pixels"])
    if record["backend"] == "pil":
        steps = {key: record.get(key) for key in ("do_convert_rgb", "resample", "do_rescale", "rescale_factor",
                                                  "do_normalize", "image_mean", "image_std")}
        steps.update(do_resize=bool(record.get("do_resize")), size={"height": height, "width": width})
        array = preprocess(image, steps)[None]
    else:
        frame = _channels_first(image, bool(record.get("do_convert_rgb")))
        if record.get("do_resize"):
            frame = resize_uint8(frame, height, width)
        array = _torch_normalize(frame[None], record)
    return _patchify(array, record)


def _video_frames(frames: Any) -> np.ndarray:
    """uint8 [F, 3, H, W] from uint8 [F, H, W, 3] frames or a list of PIL images (converted to RGB)."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InputError(f"video frames must be uint8 [frames, height, width, 3], not {frames.dtype} "
                             f"{list(frames.shape)}")
        return np.ascontiguousarray(np.moveaxis(frames, -1, 1))
    arrays = [_channels_first(frame, True) for frame in frames]
    if not arrays:
        raise InputError("a video with no frames was sent")
    if len({a.shape for a in arrays}) != 1:
        raise InputError(f"a video's frames differ in size ({sorted({a.shape[1:] for a in arrays})}); send frames "
                         "of one size")
    return np.stack(arrays)


def preprocess_qwen_video(frames: Any, record: dict[str, Any]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values_videos float32 [t*h*w, C*T*P*P], grid (t, h, w)): frames (already sampled) as the video
    processor of `record` makes them; a frame count not a multiple of temporal_patch_size repeats the last."""
    check_qwen_record(record)
    video = _video_frames(frames)
    count, _, height, width = video.shape
    if not count or not height or not width:
        raise InputError("a video with no pixels was sent")
    factor, temporal = record["patch_size"] * record["merge_size"], record["temporal_patch_size"]
    if record.get("do_resize"):
        low, high = record["min_pixels"], record["max_pixels"]
        if record["class"] == "Qwen3VLVideoProcessor":
            if record.get("cap_pixels_per_frame"):
                per_frame = max(min(record["max_video_tokens"] * factor * factor, high // count), int(low * 1.05))
                high = per_frame * count
            height, width = smart_resize_video3(count, height, width, temporal, factor, low, high)
        else:
            if record.get("cap_pixels_per_frame"):
                total = int(record["max_video_tokens"] * factor * factor * 0.9)
                high = max(min(high, total * temporal // count), int(low * 1.05))
            height, width = smart_resize(height, width, factor, low, high)
        video = resize_uint8(video, height, width)
    return _patchify(_torch_normalize(video, record), record)


def sample_frame_indices(total_frames: int, video_fps: float | None, record: dict[str, Any]) -> np.ndarray:
    """Qwen3VLVideoProcessor.sample_frames: the indices of the frames to keep from a video of total_frames at
    video_fps (None: 24, as transformers assumes), by the record's num_frames or fps."""
    if total_frames < 1:
        raise InputError("a video with no frames was sent")
    count = record.get("num_frames")
    fps = record.get("fps")
    if count is None and fps is not None:
        count = int(total_frames / (video_fps or 24) * fps)
        count = min(max(count, record.get("min_frames") or 4), record.get("max_frames") or 768, total_frames)
    if count is None:
        count = min(max(total_frames, record.get("min_frames") or 4), record.get("max_frames") or 768)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def frame_timestamps(indices: Sequence[int], video_fps: float | None, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's per-temporal-patch timestamps in seconds (the prompt's "<{t:.1f} seconds>" before each frame
    group): the mean time of the first and last frame of each group of temporal_patch_size frames."""
    indices = list(indices)
    if not indices:
        return []
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [index / (video_fps or 24) for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]
