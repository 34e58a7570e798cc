"""LLaVA-NeXT's / OneVision's pack in numpy (runtime/media/llava_next_pack.py) against transformers' own
pack_image_features: random tile features of images of 20+ sizes and aspect ratios, tiled by the runtime
(tiles_llava_next.py), at the tiny fixtures' geometry and at the released checkpoints' (336 / 384-pixel tiles),
OneVision's pooled grids included; within 1e-6, with as many rows as the processor's image tokens."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime.media.llava_next_pack import bilinear, pack_llava_next, pack_llava_onevision  # noqa: E402
from kvforge.runtime.media.tile_ops import TiledImage  # noqa: E402
from kvforge.runtime.media.tiles_llava_next import llava_next_image  # noqa: E402

HIDDEN = 8
SIZES = [(60, 70), (70, 60), (90, 180), (180, 90), (200, 150), (150, 200), (150, 60), (56, 56), (57, 113), (113, 57),
         (40, 300), (300, 40), (1, 200), (200, 1), (111, 112), (168, 56), (56, 168), (99, 33), (33, 99), (250, 251),
         (123, 45), (64, 128)]
RELEASED_SIZES = [(336, 336), (480, 640), (640, 480), (1000, 300), (300, 1000), (720, 1280), (1500, 1100)]


def _processor(side: int, pinpoints: list[list[int]], onevision: bool) -> dict[str, Any]:
    size = {"height": side, "width": side} if onevision else {"shortest_edge": side}
    return {"do_convert_rgb": True, "do_resize": True, "size": size, "resample": 3, "do_center_crop": not onevision,
            "crop_size": {"height": side, "width": side}, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_grid_pinpoints": pinpoints}


def _image(seed: int, height: int, width: int) -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8), "RGB")


def _hf_pack(onevision: bool, side: int, patch: int, pinpoints: list[list[int]], features: np.ndarray,
             tiles: int, size: tuple[int, int], newline: np.ndarray, aspect: str) -> np.ndarray:
    """transformers' pack_image_features of one image, the model's config standing in as a namespace."""
    vision = SimpleNamespace(image_size=side, patch_size=patch)
    owner = SimpleNamespace(config=SimpleNamespace(vision_config=vision, image_grid_pinpoints=pinpoints))
    per_tile = [torch.from_numpy(features).reshape(tiles, -1, features.shape[-1])]
    sizes, line = torch.tensor([list(size)]), torch.from_numpy(newline)
    if onevision:
        packed, lens = transformers.LlavaOnevisionModel.pack_image_features(owner, per_tile, sizes, line, aspect)
    else:
        packed, lens = transformers.LlavaNextModel.pack_image_features(owner, per_tile, sizes, "default", line)
    assert lens.tolist() == [packed[0].shape[0]]
    return packed[0].numpy()


def _check(onevision: bool, side: int, patch: int, pinpoints: list[list[int]], prompt: dict[str, Any],
           sizes: list[tuple[int, int]]) -> set[tuple[int, int, int]]:
    """Pack each image of `sizes` both ways; the (rows, cols, tokens) seen."""
    record = _processor(side, pinpoints, onevision)
    pack = pack_llava_onevision if onevision else pack_llava_next
    seen = set()
    rng = np.random.default_rng(0)
    for seed, size in enumerate(sizes):
        tiled = llava_next_image(_image(seed, *size), record, prompt, onevision=onevision)
        tiles, square = len(tiled.tiles), (side // patch) ** 2
        features = rng.standard_normal((tiles * square, HIDDEN)).astype(np.float32)
        newline = rng.standard_normal(HIDDEN).astype(np.float32)
        ours = pack(features, tiled, {"prompt": prompt}, [newline])
        want = _hf_pack(onevision, side, patch, pinpoints, features, tiles, size, newline,
                        prompt.get("vision_aspect_ratio", ""))
        assert ours.shape == want.shape == (tiled.image_tokens, HIDDEN), size
        np.testing.assert_allclose(ours, want, atol=1e-6, rtol=0, err_msg=str(size))
        seen.add((tiled.rows, tiled.cols, tiled.image_tokens))
    return seen


NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
NEXT_PROMPT = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
ONEVISION_PINPOINTS = [[56 * i, 56 * j] for i in range(1, 4) for j in range(1, 4)]


def test_llava_next_pack_equals_transformers() -> None:
    seen = _check(False, 56, 14, NEXT_PINPOINTS, NEXT_PROMPT, SIZES)
    assert len({grid[:2] for grid in seen}) == 5 and len({grid[2] for grid in seen}) >= 10
    released = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    assert len(_check(False, 336, 14, released, NEXT_PROMPT, RELEASED_SIZES)) >= 4


@pytest.mark.parametrize("most", ["anyres_max_4", "anyres_max_9", "anyres_max_1"])
def test_llava_onevision_pack_equals_transformers(most: str) -> None:
    prompt = {"num_image_tokens": 16, "vision_feature_select_strategy": "full", "vision_aspect_ratio": most}
    seen = _check(True, 56, 14, ONEVISION_PINPOINTS, prompt, SIZES)
    assert len({grid[:2] for grid in seen}) >= 6 and len({grid[2] for grid in seen}) >= 8


def test_llava_onevision_pack_at_the_released_shape_pools_large_grids() -> None:
    pinpoints = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
    prompt = {"num_image_tokens": 729, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}
    seen = _check(True, 384, 14, pinpoints, prompt, [*RELEASED_SIZES, (2300, 2300)])
    # 27 x 27 patches a tile: a 6x6 grid (2304 px) is pooled to 9 tiles' worth; a 1x1 one is not
    assert any(rows * cols > 9 and tokens < 729 + rows * cols * 729 / 2 for rows, cols, tokens in seen)


def test_one_tile_is_its_features_and_the_newline() -> None:
    """OneVision's image of a prompt with several images: one padded tile, then image_newline (num_image_tokens+1)."""
    record = _processor(56, ONEVISION_PINPOINTS, True)
    prompt = {"num_image_tokens": 16, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}
    tiled = llava_next_image(_image(3, 90, 40), record, prompt, onevision=True, whole=True)
    features, newline = np.arange(16 * HIDDEN, dtype=np.float32).reshape(16, HIDDEN), np.full(HIDDEN, -1, np.float32)
    out = pack_llava_onevision(features, tiled, {"prompt": prompt}, [newline])
    assert out.shape == (tiled.image_tokens, HIDDEN) == (17, HIDDEN)
    np.testing.assert_array_equal(out, np.concatenate([features, newline[None]]))


@pytest.mark.parametrize("shape", [(5, 7), (9, 3), (2, 2), (1, 6)])
def test_bilinear_equals_torch_interpolate(shape: tuple[int, int]) -> None:
    grid = np.random.default_rng(1).standard_normal((6, 8, 3)).astype(np.float32)
    want = torch.nn.functional.interpolate(torch.from_numpy(grid).permute(2, 0, 1)[None], list(shape),
                                           mode="bilinear")[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(bilinear(grid, *shape), want, atol=1e-6, rtol=0)


def test_bad_features_are_one_input_error() -> None:
    tiled = TiledImage([np.zeros((3, 56, 56), np.float32)] * 3, 1, 2, "", 0, (60, 120))
    newline = np.zeros(HIDDEN, np.float32)
    with pytest.raises(InputError, match="for 3 tiles"):
        pack_llava_next(np.zeros((47, HIDDEN), np.float32), tiled, {}, [newline])
    with pytest.raises(InputError, match="not a square"):
        pack_llava_next(np.zeros((45, HIDDEN), np.float32), tiled, {}, [newline])
    with pytest.raises(InputError, match="no image_newline"):
        pack_llava_next(np.zeros((48, HIDDEN), np.float32), tiled, {}, [])
    with pytest.raises(InputError, match="1x2 grid"):
        pack_llava_next(np.zeros((64, HIDDEN), np.float32), TiledImage([tiled.tiles[0]] * 4, 1, 2, "", 0, (9, 9)),
                        {}, [newline])
