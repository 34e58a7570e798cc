"""vision.onnx of a tiled family (InternVL, Aya Vision, ...: models/vision_families.py `tiling`): an image's tiles in as
one batch ([tiles, C, H, W], the number of tiles dynamic), their feature rows out in the order the family's
Processor writes their tokens (and the outputs its runtime arrangement reads, VisionFamily.extra_outputs).

The runtime tiles the image as the family's processor does (runtime/media/tiling.py) and writes the image's text from
the manifest's `prompt` record (the Processor's settings, VisionFamily.prompt_record), so a prompt's ids are the
Processor's and each tile's rows land on its tokens.
"""

from __future__ import annotations

import contextlib
import io as io_module
import warnings
from pathlib import Path
from typing import Any

from kvforge.core.contract import IMAGE_FEATURES, PIXEL_VALUES
from kvforge.core.errors import UnsupportedModelError
from kvforge.exporter.vision import output_shape
from kvforge.models.vision_families import VisionFamily

EXAMPLE_TILES = 2  # traced with two tiles, so the batch dimension is not specialised to one


def _tiles_module(model: Any, family: VisionFamily) -> Any:
    """forward(pixel_values [tiles, C, H, W]) -> (features [rows, hidden], *extras)."""
    import torch

    class Tiles(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            out = family.features(self.model, pixel_values)
            return out if isinstance(out, tuple) else (out,)

    return Tiles()


def trace_tiles(model: Any, family: VisionFamily, shape: tuple[int, int], torch_dtype: Any) -> tuple[Any, int]:
    """vision.onnx (an onnx_ir model) over a dynamic number of tiles of `shape`, and the feature rows a tile gives."""
    import torch

    from kvforge.core.progress import quiet_logger
    from kvforge.exporter.trace import OPSET

    channels = getattr(model.config.vision_config, "num_channels", 3)
    example = torch.zeros(EXAMPLE_TILES, channels, *shape, dtype=torch_dtype)
    wrapper = _tiles_module(model, family)
    rows = output_shape(wrapper, example)[0]
    if rows % EXAMPLE_TILES:
        raise UnsupportedModelError(f"{family.model_type}: {EXAMPLE_TILES} tiles gave {rows} feature rows, not a "
                                    "whole number a tile")
    tiles = torch.export.Dim("tiles", min=1, max=256)
    names = [IMAGE_FEATURES, *family.extra_outputs]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=[PIXEL_VALUES], output_names=names,
                                    dynamic_shapes=({0: tiles},), opset_version=OPSET, optimize=True, verbose=False)
    graph = program.model
    graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    return graph, rows // EXAMPLE_TILES


def tiles_fields(model: Any, family: VisionFamily, model_dir: Path, tokens_per_tile: int) -> dict[str, Any]:
    """The vision record's fields of a tiled family: how the runtime tiles an image, writes its text and arranges
    its rows."""
    assert family.prompt_record is not None
    return {"input": "tiles", "tiling": family.tiling, "tokens_per_image": None, "tokens_per_tile": tokens_per_tile,
            "prompt": family.prompt_record(model_dir, model.config), "before_ids": [], "after_ids": [],
            **({"pack": family.pack} if family.pack else {}),
            **({"extra_outputs": list(family.extra_outputs)} if family.extra_outputs else {})}
