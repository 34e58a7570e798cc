"""vision.onnx of the patch towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; exporter/vision_patches.py) against Hugging
Face's get_image_features on the tiny checkpoints (kvforge/tools/vlm_fixtures.py): images of different sizes and
aspect ratios one per call and two in one call, through onnxruntime CPU, fp32 within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.exporter.vision_patches import patch_vision_io, trace_patch_vision  # noqa: E402
from kvforge.models.families.qwen_vl_tower import TOWER_INPUTS, tower_inputs  # noqa: E402
from kvforge.tools.vlm_fixtures import build_tiny_vlm  # noqa: E402

FAMILIES = sorted(TOWER_INPUTS)
TOLERANCE = 1e-4
# (height, width): the smallest grid, a wide one and a tall one.
SIZES = ((28, 28), (120, 300), (300, 90))
pytestmark = pytest.mark.xdist_group("qwen-vl-vision")


def _image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8), "RGB")


class Traced:
    """A family's tiny checkpoint, its traced vision.onnx in an onnxruntime session, and HF's image processor."""

    def __init__(self, family: str, root) -> None:
        import warnings

        import onnx_ir as ir
        from transformers import AutoImageProcessor

        self.family, folder = family, root / family
        self.model = build_tiny_vlm(family, folder)
        ir.save(trace_patch_vision(self.model, family, torch.float32), str(folder / "vision.onnx"))
        self.session = ort.InferenceSession(str(folder / "vision.onnx"), providers=["CPUExecutionProvider"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.processor = AutoImageProcessor.from_pretrained(folder)
        self.images = [_image(seed, *size) for seed, size in enumerate(SIZES)]

    def inputs(self, images: list) -> tuple[dict, torch.Tensor]:
        """The processor's pixel_values and grid_thw of `images`, and the graph's feeds from them."""
        out = self.processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        feeds = {"pixel_values": out["pixel_values"].numpy(),
                 **{name: value.numpy() for name, value in tower_inputs(self.model, grid).items()}}
        return feeds, grid

    def reference(self, feeds: dict, grid: torch.Tensor) -> list[np.ndarray]:
        """HF's image features (with Qwen3's DeepStack features along each row), each image's concatenated in order."""
        with torch.no_grad():
            out = self.model.model.get_image_features(torch.from_numpy(feeds["pixel_values"]), grid)
        ref = [torch.cat(list(out.pooler_output), 0)]
        # Qwen3's DeepStack features ride in each token's row, after its features
        ref += [torch.cat(list(layer), 0) for layer in getattr(out, "deepstack_features", None) or ()]
        return [torch.cat(ref, -1).numpy()]

    def run(self, feeds: dict) -> list[np.ndarray]:
        return self.session.run(None, feeds)


@pytest.fixture(scope="module", params=FAMILIES)
def traced(request, tmp_path_factory) -> Traced:
    return Traced(request.param, tmp_path_factory.mktemp("qwen_vl"))


def _max_errors(got: list[np.ndarray], ref: list[np.ndarray]) -> list[float]:
    assert [g.shape for g in got] == [r.shape for r in ref]
    return [float(np.abs(g - r).max()) for g, r in zip(got, ref, strict=True)]


def test_graph_io(traced: Traced) -> None:
    names, outputs = patch_vision_io(traced.family)
    assert [i.name for i in traced.session.get_inputs()] == list(names)
    assert [o.name for o in traced.session.get_outputs()] == list(outputs)
    types = {i.name: i.type for i in traced.session.get_inputs()}
    want = {"pixel_values": "float", "position_ids": "int64", "cu_seqlens": "int32", "window_index": "int64",
            "cu_window_seqlens": "int32", "interp_indices": "int64", "interp_weights": "float"}
    assert types == {name: f"tensor({want[name]})" for name in names}
    layers = 1 + len(getattr(traced.model.config.vision_config, "deepstack_visual_indexes", None) or ())
    assert traced.session.get_outputs()[0].shape == ["image_tokens", traced.model.config.text_config.hidden_size * layers]
    # The tracing-time attention is undone: HF's model is unchanged after the export.
    assert all("forward" not in vars(block.attn) for block in traced.model.model.visual.blocks)


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_one_image_per_call(traced: Traced, index: int) -> None:
    feeds, grid = traced.inputs([traced.images[index]])
    errors = _max_errors(traced.run(feeds), traced.reference(feeds, grid))
    print(f"{traced.family} image {SIZES[index]} grid {grid.tolist()}: max abs err {errors}")
    assert max(errors) < TOLERANCE


def test_images_have_different_grids(traced: Traced) -> None:
    grids = [tuple(traced.inputs([image])[1][0].tolist()) for image in traced.images]
    assert len(set(grids)) == len(grids)
    assert grids[1][2] > grids[1][1] and grids[2][1] > grids[2][2]  # wide, tall


def test_two_images_in_one_call(traced: Traced) -> None:
    feeds, grid = traced.inputs(traced.images[1:])
    assert len(grid) == 2 and len(feeds["cu_seqlens"]) == 3
    got = traced.run(feeds)
    errors = _max_errors(got, traced.reference(feeds, grid))
    print(f"{traced.family} two images {grid.tolist()}: max abs err {errors}")
    assert max(errors) < TOLERANCE
    # Each image's tokens are what it gives alone: the mask keeps the images apart.
    alone = [traced.run(traced.inputs([image])[0])[0] for image in traced.images[1:]]
    assert np.abs(got[0] - np.concatenate(alone, 0)).max() < TOLERANCE


def test_one_segment_for_two_images_differs(traced: Traced) -> None:
    """The graph's attention follows cu_seqlens: one segment over both images changes the features."""
    feeds, _ = traced.inputs(traced.images[1:])
    joined = {**feeds, "cu_seqlens": feeds["cu_seqlens"][[0, -1]]}
    assert np.abs(traced.run(joined)[0] - traced.run(feeds)[0]).max() > 0.1


def test_qwen2_5_windows(traced: Traced) -> None:
    if traced.family != "qwen2_5_vl":
        pytest.skip("windowed attention is Qwen2.5-VL's")
    config = traced.model.model.visual.config
    assert 0 < len(config.fullatt_block_indexes) < config.depth
    split = []
    for image in traced.images:
        feeds, _ = traced.inputs([image])
        split.append(len(feeds["cu_window_seqlens"]) > len(feeds["cu_seqlens"]))
    assert any(split)
    # The windowed blocks' segments reach the graph: windows as wide as the image change its features.
    feeds, _ = traced.inputs([traced.images[1]])
    whole = {**feeds, "cu_window_seqlens": feeds["cu_seqlens"]}
    assert np.abs(traced.run(whole)[0] - traced.run(feeds)[0]).max() > 0.1


def test_unknown_family_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="llava: no patch-based image tower"):
        patch_vision_io("llava")
