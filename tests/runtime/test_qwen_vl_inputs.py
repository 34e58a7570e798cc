"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL inputs made without torch (runtime/media/qwen_vl_preprocess.py, mrope.py,
antialias_resize.py) equal to transformers 5.24's: pixel values and grids byte for byte on 20 varied images, the
torch uint8 bicubic resize, video frames (where torchvision is installed), get_rope_index's positions, and the
vision tower's precomputed inputs (also fed to a tiny tower in place of its own)."""

from __future__ import annotations

import numpy as np
import pytest
from test_vision_inputs import IMAGES, _image

from kvforge.core.errors import InputError
from kvforge.exporter.vision_mrope import qwen_processor_record
from kvforge.models.families.qwen_vl import mrope_record
from kvforge.runtime.media.antialias_resize import resize_uint8
from kvforge.runtime.media.mrope import mrope_positions, tower_inputs
from kvforge.runtime.media.qwen_vl_preprocess import (
    frame_timestamps,
    preprocess_qwen,
    preprocess_qwen_video,
    sample_frame_indices,
)

pytest.importorskip("transformers")
# Qwen2-VL's and Qwen3-VL's image processor settings, with pixel bounds small enough that the images' grids vary.
IMAGE_SETTINGS = {"qwen2": {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64},
                  "qwen3": {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 40}, "patch_size": 16,
                            "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}


@pytest.mark.parametrize("setting", sorted(IMAGE_SETTINGS))
def test_images_equal_transformers_pil_processor(setting: str) -> None:
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**IMAGE_SETTINGS[setting])
    record = qwen_processor_record(processor)
    assert record["backend"] == "pil" and record["patch_size"] == (16 if setting == "qwen3" else 14)
    grids = set()
    for seed, (height, width, mode) in enumerate(IMAGES):
        image = _image(seed, height, width, mode)
        theirs = processor(images=image, return_tensors="np")
        ours, grid = preprocess_qwen(image, record)
        assert grid == tuple(theirs["image_grid_thw"][0].tolist())
        assert ours.dtype == np.float32 and ours.shape == theirs["pixel_values"].shape
        np.testing.assert_array_equal(ours, theirs["pixel_values"])
        grids.add(grid)
    assert len(grids) >= 10  # the bounds really vary the sizes


def test_resize_equals_torch_uint8_bicubic() -> None:
    """torchvision resizes uint8 with F.interpolate(uint8, bicubic, antialias=True): equal to the byte."""
    import torch
    import torch.nn.functional as F

    rng = np.random.RandomState(0)
    for height, width, new_h, new_w in [(50, 70, 56, 84), (300, 40, 112, 28), (13, 17, 28, 28), (640, 480, 224, 168),
                                        (57, 1000, 28, 504), (2, 2, 56, 56), (96, 160, 448, 728), (70, 90, 70, 56)]:
        frames = rng.randint(0, 256, (2, 3, height, width)).astype(np.uint8)
        theirs = F.interpolate(torch.from_numpy(frames), size=[new_h, new_w], mode="bicubic", align_corners=False,
                               antialias=True).numpy()
        ours = resize_uint8(frames, new_h, new_w)
        assert ours.dtype == np.uint8 and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


# max_video_tokens small enough that cap_pixels_per_frame changes sizes.
VIDEO_SETTINGS = {"Qwen2VLVideoProcessor": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64},
                                            "max_video_tokens": 20},
                  "Qwen3VLVideoProcessor": {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 256},
                                            "do_sample_frames": False, "max_video_tokens": 8}}


@pytest.mark.parametrize("name", sorted(VIDEO_SETTINGS))
@pytest.mark.parametrize("cap", [False, True])
def test_video_frames_equal_transformers(name: str, cap: bool) -> None:
    """The video processors are torchvision-only (skipped without it), as is the torchvision image backend."""
    pytest.importorskip("torchvision")
    import transformers

    processor = getattr(transformers, name)(**VIDEO_SETTINGS[name])
    record = qwen_processor_record(processor) | {"cap_pixels_per_frame": cap}
    grids = set()
    for seed, (height, width, _) in enumerate(IMAGES[:12]):
        frames = np.stack([np.array(_image(seed * 10 + i, height, width, "RGB")) for i in range(4 if seed % 3 else 3)])
        theirs = processor(videos=[frames], return_tensors="np", cap_pixels_per_frame=cap, do_sample_frames=False)
        ours, grid = preprocess_qwen_video(frames, record)
        assert grid == tuple(theirs["video_grid_thw"][0].tolist())
        np.testing.assert_array_equal(ours, theirs["pixel_values_videos"])
        grids.add(grid)
    assert len(grids) >= 8
    image_processor = transformers.Qwen2VLImageProcessor(**IMAGE_SETTINGS["qwen2"])
    assert image_processor.backend == "torchvision"
    image_record = qwen_processor_record(image_processor)
    for seed, (height, width, _) in enumerate(IMAGES):
        image = _image(seed, height, width, "RGB")
        ours, _ = preprocess_qwen(image, image_record)
        np.testing.assert_array_equal(ours, image_processor(images=image, return_tensors="np")["pixel_values"])


def test_video_pipeline_without_torchvision() -> None:
    """Four frames: the grid, the frame order within each patch, and the normalisation torchvision's backend uses
    (mean and std times 255 in float32), checked against a direct statement of transformers' patchify."""
    record = {"class": "Qwen2VLVideoProcessor", "backend": "torchvision", "min_pixels": 56 * 56,
              "max_pixels": 28 * 28 * 64, "do_convert_rgb": True, "do_resize": True, "resample": 3,
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.4, 0.3],
              "image_std": [0.2, 0.25, 0.3], "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    frames = np.stack([np.array(_image(i, 56, 84, "RGB")) for i in range(4)])  # no resize needed: 56x84 fits
    ours, grid = preprocess_qwen_video(frames, record)
    assert grid == (2, 4, 6) and ours.shape == (48, 3 * 2 * 14 * 14)
    mean = np.float32([0.5, 0.4, 0.3]) * np.float32(255.0)
    std = np.float32([0.2, 0.25, 0.3]) * np.float32(255.0)
    normalised = (np.moveaxis(frames, -1, 1).astype(np.float32) - mean[:, None, None]) / std[:, None, None]
    # token 7: frame group 0, merge block (0, 1), patch (1, 1) of it: rows 14..28, columns 42..56
    token = ours[7].reshape(3, 2, 14, 14)
    np.testing.assert_array_equal(token, normalised[0:2, :, 14:28, 42:56].transpose(1, 0, 2, 3))
    token = ours[24 + 2].reshape(3, 2, 14, 14)  # frame group 1, block (0, 0), patch (1, 0)
    np.testing.assert_array_equal(token, normalised[2:4, :, 14:28, 0:14].transpose(1, 0, 2, 3))
    odd, grid = preprocess_qwen_video(frames[:3], record)  # 3 frames: the last repeated
    assert grid == (2, 4, 6)
    np.testing.assert_array_equal(odd[24:].reshape(24, 3, 2, 196)[:, :, 0], odd[24:].reshape(24, 3, 2, 196)[:, :, 1])


def test_refusals() -> None:
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**IMAGE_SETTINGS["qwen2"])
    record = qwen_processor_record(processor)
    wide = _image(0, 2, 500, "RGB")
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(images=wide, return_tensors="np")
    with pytest.raises(InputError, match="aspect ratio over 200"):
        preprocess_qwen(wide, record)
    video = {**record, "class": "Qwen3VLVideoProcessor", "backend": "torchvision", "patch_size": 16}
    with pytest.raises(InputError, match="1 frame"):
        preprocess_qwen_video(np.zeros((1, 64, 64, 3), np.uint8), video)
    with pytest.raises(InputError, match="differ in size"):
        preprocess_qwen_video([_image(0, 40, 40, "RGB"), _image(1, 40, 41, "RGB")], video)
    with pytest.raises(InputError, match="not a Qwen-VL processor"):
        preprocess_qwen(wide, {**record, "class": "CLIPImageProcessor"})
    with pytest.raises(InputError, match="resample"):
        preprocess_qwen(wide, {**record, "backend": "torchvision", "resample": 2})


def test_qwen3_frame_sampling_and_timestamps() -> None:
    """Qwen3VLVideoProcessor.sample_frames and Qwen3VLProcessor._calculate_timestamps, called on stand-ins."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    try:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    except ImportError:
        pytest.skip("transformers' Qwen3-VL video processor needs torchvision")
    for fps, num_frames, total, video_fps in [(2, None, 100, 30.0), (2, None, 10, 24.0), (None, 6, 50, 25.0),
                                              (1, None, 1000, 10.0)]:
        record = {"fps": fps, "num_frames": num_frames, "min_frames": 4, "max_frames": 64}
        stand_in = SimpleNamespace(fps=2, min_frames=4, max_frames=64)
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
        theirs = Qwen3VLVideoProcessor.sample_frames(stand_in, metadata, num_frames=num_frames, fps=fps)
        ours = sample_frame_indices(total, video_fps, record)
        np.testing.assert_array_equal(ours, theirs)
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(ours), video_fps, 2)
        assert frame_timestamps(ours, video_fps, 2) == stamps


def _model(model_type: str):
    import torch
    import transformers

    from kvforge.tools.vlm_fixtures import tiny_vlm_config

    config = tiny_vlm_config(model_type)
    torch.manual_seed(0)
    name = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel"}[model_type]
    return getattr(transformers, name)._from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def _prompt(parts: list[tuple[str, tuple[int, int, int]] | int], config, qwen3: bool) -> list[int]:
    """Token ids: text runs of n ids, and each image/video between vision_start / vision_end (a Qwen3-VL video as
    one such block per frame group, a 2-token timestamp before each)."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids += [5 + i % 40 for i in range(part)]
            continue
        kind, (t, h, w) = part
        token = config.image_token_id if kind == "image" else config.video_token_id
        blocks = t if kind == "video" and qwen3 else 1
        for _ in range(blocks):
            ids += [7, 8] if blocks > 1 or (kind == "video" and qwen3) else []
            ids += [config.vision_start_token_id] + [token] * (t // blocks * h * w // 4) + [config.vision_end_token_id]
    return ids


PROMPTS = {"text only": [9],
           "one image": [3, ("image", (1, 4, 6)), 5],
           "two images": [2, ("image", (1, 8, 4)), 3, ("image", (1, 2, 10)), 4],
           "image and video": [2, ("image", (1, 6, 6)), 2, ("video", (3, 4, 8)), 6],
           "video first, text between": [("video", (2, 6, 4)), 7, ("image", (1, 4, 4)), 1, ("video", (4, 2, 2)), 3]}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_equal_get_rope_index(model_type: str) -> None:
    import torch

    model = _model(model_type)
    config, record = model.config, mrope_record(model.config)
    qwen3 = model_type == "qwen3_vl"
    for name, parts in PROMPTS.items():
        ids = _prompt(parts, config, qwen3)
        media = [part for part in parts if not isinstance(part, int)]
        images = [grid for kind, grid in media if kind == "image"]
        videos = [grid for kind, grid in media if kind == "video"]
        seconds = [2 / 3, 0.5][:len(videos)]  # temporal_patch_size / fps at 3 and 4 fps
        kwargs = {"second_per_grid_ts": torch.tensor(seconds)} if model_type == "qwen2_5_vl" and videos else {}
        types = torch.tensor([[1 if i == config.image_token_id else 2 if i == config.video_token_id else 0
                               for i in ids]])
        theirs, delta = model.get_rope_index(
            torch.tensor([ids]), types, image_grid_thw=torch.tensor(images) if images else None,
            video_grid_thw=torch.tensor(videos) if videos else None, **kwargs)
        ours, our_delta = mrope_positions(
            ids, [grid for _, grid in media], image_token_id=record["image_token_id"],
            video_token_id=record["video_token_id"], spatial_merge_size=record["spatial_merge_size"],
            video_time_scale=record["video_time_scale"], frame_runs=record["frame_runs"],
            video_seconds=seconds if kwargs else None)
        assert ours.dtype == np.int64 and ours.shape == (3, len(ids)), name
        np.testing.assert_array_equal(ours, theirs[:, 0].numpy(), err_msg=name)
        assert our_delta == int(delta), name
        if media:
            assert our_delta != 0 and not (ours[0] == ours[1]).all(), name  # the case really is 3-D
    with pytest.raises(InputError, match="does not match grid"):
        mrope_positions(_prompt([1, ("image", (1, 4, 4)), 1], config, qwen3), [(1, 4, 6)],
                        image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                        spatial_merge_size=2, frame_runs=qwen3)
    with pytest.raises(InputError, match="no run of tokens"):
        mrope_positions([1, 2, 3], [(1, 4, 6)], image_token_id=config.image_token_id,
                        video_token_id=config.video_token_id, spatial_merge_size=2, frame_runs=qwen3)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tower_inputs_equal_transformers(model_type: str) -> None:
    import torch
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
        get_vision_window_index,
    )

    model = _model(model_type)
    vision, record = model.visual, mrope_record(model.config)
    merge = record["spatial_merge_size"]
    extra = {"window_size": record["window_size"], "patch_size": record["patch_size"]} \
        if model_type == "qwen2_5_vl" else {}
    if model_type == "qwen3_vl":
        extra = {"num_position_embeddings": record["num_position_embeddings"]}
    for grids in ([(1, 4, 6)], [(1, 8, 4), (1, 2, 10)], [(1, 6, 6), (2, 4, 8), (1, 10, 2)]):
        ours = tower_inputs(grids, merge, **extra)
        grid_thw = torch.tensor(grids)
        theirs = {"position_ids": get_vision_position_ids(grid_thw, merge), "cu_seqlens": get_vision_cu_seqlens(grid_thw)}
        if model_type == "qwen2_5_vl":
            theirs["window_index"], theirs["cu_window_seqlens"] = get_vision_window_index(
                grid_thw, merge, record["window_size"], record["patch_size"])
        if model_type == "qwen3_vl":
            theirs["interp_indices"], theirs["interp_weights"] = get_vision_interpolation_indices_and_weights(
                grid_thw, vision.num_grid_per_side, mode="bilinear", align_corners=True, spatial_merge_size=merge)
        assert sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert ours[key].dtype == value.numpy().dtype, key
            np.testing.assert_array_equal(ours[key], value.numpy(), err_msg=key)
    # The tower takes them in place of its own: given another grid with as many patches, it computes as for the
    # grid the inputs were made for, so the kwarg names are the ones its forward pops.
    grids, other = [(1, 4, 8), (1, 2, 2)], [(1, 8, 4), (1, 2, 2)]
    patch_dim = 3 * 2 * record["patch_size"] ** 2
    pixels = torch.randn(36, patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vision(pixels, grid_thw=torch.tensor(grids)).pooler_output
        plain = vision(pixels, grid_thw=torch.tensor(other)).pooler_output
        given = {k: torch.from_numpy(v) for k, v in tower_inputs(grids, merge, **extra).items()}
        got = vision(pixels, grid_thw=torch.tensor(other), **given).pooler_output
    assert not torch.allclose(plain, want, atol=1e-4)  # the grid matters to the tower
    torch.testing.assert_close(got, want, rtol=0, atol=0)
