"""`vision.onnx` for the towers that take each image at its own size (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the image
path of exporter/vision.py takes one fixed-size image [1, C, H, W]; these take the processor's patches
[patches, C*T*P*P] of any number of images of any grids, with the arrays the tower derives from grid_thw as inputs
(models/families/qwen_vl_tower.py TOWER_INPUTS; the runtime computes them in numpy).

Every patch-count dimension is dynamic, as are the segment counts (images; Qwen2.5's windows): one graph serves
any image sizes and several images per call. The patch count is traced as merge^2 * tokens, so the graph's
reshapes into merge groups need no runtime check.
"""

from __future__ import annotations

import contextlib
import io as io_module
import warnings
from typing import Any

from kvforge.core.contract import IMAGE_FEATURES, PIXEL_VALUES
from kvforge.core.errors import UnsupportedModelError

# The example grids traced (t, h, w in patches): two images, so that no image or segment count is specialised to 1,
# each spanning several of Qwen2.5's windows.
_EXAMPLE_GRIDS = ((1, 4, 8), (1, 6, 4))


def patch_vision_io(family: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The graph's input and output names for a family with a patch tower."""
    from kvforge.models.families.qwen_vl_tower import TOWER_INPUTS

    if family not in TOWER_INPUTS:
        raise UnsupportedModelError(f"{family}: no patch-based image tower kvforge traces "
                                    f"({', '.join(TOWER_INPUTS)})")
    return (PIXEL_VALUES, *TOWER_INPUTS[family]), (IMAGE_FEATURES,)


def _dynamic_shapes(names: tuple[str, ...], merge_unit: int) -> tuple[Any, ...]:
    """dynamic_shapes for (pixel_values, *inputs): patches = merge_unit * tokens, segments and windows free."""
    from torch.export import Dim

    tokens = Dim("image_tokens", min=1)
    patches = merge_unit * tokens
    by_name = {"position_ids": {0: patches}, "cu_seqlens": {0: Dim("segments_plus_one", min=2)},
               "window_index": {0: tokens}, "cu_window_seqlens": {0: Dim("windows_plus_one", min=2)},
               "interp_indices": {0: patches}, "interp_weights": {0: patches}}
    return {0: patches}, tuple(by_name[name] for name in names)


def trace_patch_vision(model: Any, family: str, torch_dtype: Any) -> Any:
    """vision.onnx (an onnx_ir model) of a Qwen VL checkpoint loaded whole (its `...ForConditionalGeneration`,
    eager attention): pixel_values [patches, C*T*P*P] and TOWER_INPUTS[family] in, image_features
    [patches / merge^2, text hidden] out (Qwen3-VL: [tokens, text hidden * (1 + DeepStack layers)])."""
    import torch

    from kvforge.core.progress import quiet_logger
    from kvforge.exporter.trace import OPSET
    from kvforge.models.families.qwen_vl_tower import mask_attention, tower_inputs, tower_module
    from kvforge.models.families.surgery import Patches

    input_names, output_names = patch_vision_io(family)
    visual = model.model.visual
    config = visual.config
    grids = torch.tensor(_EXAMPLE_GRIDS, dtype=torch.int64)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.zeros(int(grids.prod(-1).sum()), width, dtype=torch_dtype)
    inputs = tower_inputs(model, grids)
    # All as HF's helpers give them, whatever the export's dtype (Qwen3's interp_weights stay float32: HF resamples
    # the position grid in float32 and casts the sum).
    args = tuple(inputs[name] for name in input_names[1:])
    shapes = _dynamic_shapes(input_names[1:], config.spatial_merge_size ** 2)
    with Patches() as patches, warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), \
            quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        mask_attention(visual, patches)  # the per-segment Python loop of HF's eager attention does not trace
        program = torch.onnx.export(tower_module(model), (pixels, *args), dynamo=True, input_names=list(input_names),
                                    output_names=list(output_names), dynamic_shapes=shapes, opset_version=OPSET,
                                    optimize=True, verbose=False)
    onnx_model = program.model
    onnx_model.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    _name_token_dims(onnx_model.graph)
    return onnx_model


def _name_token_dims(graph: Any) -> None:
    """The outputs' token dimension named as the inputs' (the exporter leaves it an anonymous symbol)."""
    import onnx_ir as ir

    for value in graph.outputs:
        dims = list(value.shape)
        dims[-2] = "image_tokens"
        value.shape = ir.Shape(dims)
