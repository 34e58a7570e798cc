"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL positions without torch: the language model's 3-axis M-RoPE position ids of a
prompt (transformers 5.24's `model.model.get_rope_index` for one unpadded row) and the vision tower's precomputed
inputs (transformers' vision_utils get_vision_position_ids / get_vision_cu_seqlens / get_vision_window_index).

After the prompt, a generated token at cache position p has position p + delta on all three axes (transformers adds
its rope_deltas the same way). Qwen3-VL's interleaved M-RoPE layout is applied inside the model, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvforge.core.errors import InputError

# The fields of an export's `vision.mrope` record (exporter/vision_mrope.py) that mrope_positions takes as options.
OPTIONS = ("video_time_scale", "frame_runs")


def _runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """(type, start, end) of each run of equal token types, as transformers groups them."""
    edges = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(types)]])
    return [(int(types[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _vision_positions(start: int, grid: tuple[int, int, int], merge: int, interval: Any) -> np.ndarray:
    """[3, t*h*w/merge**2]: temporal index * interval (truncated, after float32 math as torch does) + start; the
    row and column within the merged grid + start."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    if isinstance(interval, float | np.floating):
        temporal = (np.arange(t, dtype=np.float32) * interval).astype(np.int64)
    else:
        temporal = np.arange(t, dtype=np.int64) * int(interval)
    axes = np.meshgrid(temporal, np.arange(h) + start, np.arange(w) + start, indexing="ij")
    positions = np.stack(axes).reshape(3, -1).astype(np.int64)
    positions[0] += start
    return positions


def mrope_positions(ids: Sequence[int] | np.ndarray, grids: Sequence[Sequence[int]], *, image_token_id: int,
                    video_token_id: int, spatial_merge_size: int, video_time_scale: float | None = None,
                    frame_runs: bool = False, video_seconds: Sequence[float] | None = None) -> tuple[np.ndarray, int]:
    """(positions int64 [3, len(ids)], delta) of one prompt, equal to transformers' get_rope_index.

    `grids`: the (t, h, w) patch grid of each image and video in the order they appear in `ids` (images and videos
    interleaved as in the prompt). A run of image_token_id (video_token_id) tokens is one image (video); with
    `frame_runs` (Qwen3-VL) a video's t frame groups are t runs (timestamps between them). `video_time_scale`
    (Qwen2.5-VL's tokens_per_second): a video's temporal positions advance that much per second, `video_seconds`
    giving per video the seconds one temporal patch spans (temporal_patch_size / fps; 1.0 each when None, as
    transformers does); without it they advance by one. InputError when the runs and grids disagree."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    types = np.where(ids == image_token_id, 1, np.where(ids == video_token_id, 2, 0))
    queue = _grid_queue(grids, types, frame_runs)
    seconds = list(video_seconds) if video_seconds is not None else None
    merge, pieces, current, used = spatial_merge_size, [], 0, 0
    for kind, start, end in _runs(types):
        if kind == 0:
            pieces.append(np.broadcast_to(np.arange(current, current + end - start), (3, end - start)))
            current += end - start
            continue
        if used >= len(queue):
            raise InputError(f"the prompt has more image/video token runs than the {len(grids)} grid(s) sent")
        grid, video_index = queue[used]
        used += 1
        tokens = grid[0] * grid[1] * grid[2] // merge**2
        if tokens != end - start:
            raise InputError(f"a run of {end - start} {'image' if kind == 1 else 'video'} tokens at {start} does not "
                             f"match grid {list(grid)} ({tokens} tokens)")
        interval: Any = 1
        if kind == 2 and video_time_scale is not None:
            # transformers multiplies by the processor's float32 second_per_grid_ts in float32; without them by 1
            interval = video_time_scale if seconds is None else \
                np.float32(np.float32(video_time_scale) * np.float32(seconds[video_index]))
        pieces.append(_vision_positions(current, grid, merge, interval))
        current += max(grid[1], grid[2]) // merge
    if used != len(queue):
        raise InputError(f"{len(queue) - used} image/video grid(s) have no run of tokens in the prompt")
    if not pieces:
        return np.zeros((3, 0), dtype=np.int64), 0
    positions = np.concatenate(pieces, axis=1).astype(np.int64)
    return positions, int(positions.max()) + 1 - len(ids)


def _grid_queue(grids: Sequence[Sequence[int]], types: np.ndarray,
                frame_runs: bool) -> list[tuple[tuple[int, int, int], int]]:
    """(grid, video number) per run of media tokens: `frame_runs` (Qwen3-VL) splits a video's grid into t grids of
    t=1."""
    queue: list[tuple[tuple[int, int, int], int]] = []
    kinds = [kind for kind, _, _ in _runs(types) if kind]
    videos = 0
    for grid in grids:
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1:
            raise InputError(f"grid {list(grid)} has a side under 1")
        is_video = len(queue) < len(kinds) and kinds[len(queue)] == 2
        if is_video and frame_runs:
            queue.extend(((1, h, w), videos) for _ in range(t))
        else:
            queue.append(((t, h, w), videos if is_video else -1))
        videos += is_video
    return queue


def _vision_position_ids(grids: np.ndarray, merge: int) -> np.ndarray:
    """[patches, 2] (row, column) of each patch, merge x merge blocks row-major, repeated per frame."""
    pieces = []
    for t, h, w in grids.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        pieces.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(pieces).astype(np.int64)


def _window_index(grids: np.ndarray, merge: int, window_size: int, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window attention: (window_index [merged tokens] int64, cu_window_seqlens int32)."""
    side = window_size // merge // patch_size
    unit, offset = merge * merge, 0
    indices, bounds = [], [0]
    for t, h, w in grids.tolist():
        gh, gw = h // merge, w // merge
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        index = np.full((t, gh + pad_h, gw + pad_w), -100, dtype=np.int64)
        index[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
        index = index.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        seqlens = (index != -100).sum(-1).reshape(-1)
        flat = index.reshape(-1)
        indices.append(flat[flat != -100] + offset)
        bounds.extend((np.cumsum(seqlens) * unit + bounds[-1]).tolist())
        offset += t * gh * gw
    cu = np.asarray(bounds, dtype=np.int32)
    keep = np.concatenate([[True], cu[1:] != cu[:-1]])  # torch.unique_consecutive
    return np.concatenate(indices), cu[keep]


def _interpolation(grids: np.ndarray, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned position grid (side x side) resampled to each grid: bilinear, align_corners=True, as
    transformers' get_vision_interpolation_indices_and_weights computes it in float32 ([patches, 4] each)."""
    rows, cols, sizes_h, sizes_w = [], [], [], []
    for t, h, w in grids.tolist():
        within = np.tile(np.arange(h * w), t)
        blocks_w = w // merge
        in_col, in_row = within % merge, (within // merge) % merge
        block_col, block_row = (within // (merge * merge)) % blocks_w, within // (merge * merge * blocks_w)
        rows.append(block_row * merge + in_row)
        cols.append(block_col * merge + in_col)
        sizes_h.append(np.full(t * h * w, h))
        sizes_w.append(np.full(t * h * w, w))

    def axis(index: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        src = (index.astype(np.float32) * np.float32(side - 1)) / np.maximum(size - 1, 1).astype(np.float32)
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        distance = np.abs((src - floor)[:, None] - offsets.astype(np.float32))
        return taps, np.maximum(np.float32(1) - distance, np.float32(0))

    h_taps, h_weights = axis(np.concatenate(rows), np.concatenate(sizes_h))
    w_taps, w_weights = axis(np.concatenate(cols), np.concatenate(sizes_w))
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices.astype(np.int64), weights.astype(np.float32)


def tower_inputs(grids: Sequence[Sequence[int]], spatial_merge_size: int, window_size: int | None = None,
                 patch_size: int | None = None, num_position_embeddings: int | None = None) -> dict[str, np.ndarray]:
    """The vision tower's precomputed inputs for a batch of images/videos of these (t, h, w) grids, named as the
    transformers 5.24 tower's forward accepts them in kwargs: position_ids int64 [patches, 2], cu_seqlens int32
    [frames + 1]; with window_size and patch_size (Qwen2.5-VL) also window_index int64 [patches / merge**2] and
    cu_window_seqlens int32 [windows + 1]; with num_position_embeddings (Qwen3-VL) interp_indices int64 and
    interp_weights float32 [patches, 4]."""
    array = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if not len(array) or array.min() < 1:
        raise InputError(f"vision grids {array.tolist()} need at least one grid with sides of at least 1")
    if (array[:, 1:] % spatial_merge_size).any():
        raise InputError(f"vision grids {array.tolist()} are not multiples of spatial_merge_size {spatial_merge_size}")
    seqlens = np.repeat(array[:, 1] * array[:, 2], array[:, 0])
    result = {"position_ids": _vision_position_ids(array, spatial_merge_size),
              "cu_seqlens": np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)}
    if window_size is not None and patch_size is not None:
        result["window_index"], result["cu_window_seqlens"] = _window_index(
            array, spatial_merge_size, window_size, patch_size)
    if num_position_embeddings is not None:
        result["interp_indices"], result["interp_weights"] = _interpolation(
            array, spatial_merge_size, int(num_position_embeddings**0.5))
    return result
