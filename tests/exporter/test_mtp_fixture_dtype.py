"""models/mtp_fixture.py's add_mtp_layers on a half-precision checkpoint (benchmarks/mtp_head_cost.py's 1B case):
the MTP layer is written in the checkpoint's dtype, so the exporter's one-dtype check (exporter/checkpoint.py)
accepts the folder, and the layer reads back complete (models/mtp.py's read_mtp_layer)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_mtp_layer_takes_the_checkpoint_dtype(tmp_path: Path, family: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from kvforge.exporter.checkpoint import open_checkpoint
    from kvforge.models.mtp import read_mtp_layer
    from kvforge.models.mtp_fixture import add_mtp_layers
    from kvforge.tools.coverage_fixtures import build_tiny

    folder = tmp_path / "hf"
    build_tiny(family, folder)
    file = folder / "model.safetensors"
    save_file({name: t.to(torch.float16) for name, t in load_file(str(file)).items()}, str(file),
              metadata={"format": "pt"})
    written = add_mtp_layers(folder, seed=3)
    tensors = load_file(str(file))
    assert written and {str(tensors[name].dtype) for name in written} == {"torch.float16"}
    assert all(torch.isfinite(tensors[name].float()).all() for name in written)
    checkpoint = open_checkpoint(folder)  # InputError "mix dtypes" where the layer was written in float32
    layer = read_mtp_layer(AutoConfig.from_pretrained(folder), checkpoint)
    assert layer.glue["proj"].dtype == torch.float16 and layer.block
