"""Seeded random MTP layers added to a tiny checkpoint (tests, and trying the draft head export without a hub):
the tensors a real checkpoint of the family ships (models/mtp.py's formats), written into its model.safetensors,
and `num_nextn_predict_layers` set in its config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError


def _template_layer(config: dict[str, Any]) -> int:
    """The target layer whose tensors the MTP block copies the shapes of: the last layer of full attention (the
    last layer where the config has no layer kinds; an MoE layer in the MoE families)."""
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and "full_attention" in kinds:
        return max(i for i, kind in enumerate(kinds) if kind == "full_attention")
    return int(config["num_hidden_layers"]) - 1


def add_mtp_layers(folder: str | Path, seed: int = 0, layers: int = 1, scale: float = 0.2) -> list[str]:
    """Write `layers` seeded MTP layers into the one-file checkpoint at `folder` and declare them in its config;
    returns the names written. Norm gains are 1 + noise, every other tensor noise of std `scale` (shaped like the
    template layer's, models/mtp.py's names and prefixes), in the template layer's float dtype."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from kvforge.models.mtp import FORMATS

    folder = Path(folder)
    file = folder / "model.safetensors"
    if not file.is_file():
        raise InputError(f"{folder}: add_mtp_layers takes a one-file checkpoint (model.safetensors)")
    raw = json.loads((folder / "config.json").read_text())
    fmt = FORMATS.get(raw.get("model_type"))
    if fmt is None:
        raise InputError(f"{folder}: no MTP format for model type {raw.get('model_type')!r}")
    config = AutoConfig.from_pretrained(folder)
    config.num_nextn_predict_layers = layers
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)

    template = f"model.layers.{_template_layer(raw)}."
    # The checkpoint's own float dtype (its template layer's): the exporter streams one weights dtype, as real
    # checkpoints ship their MTP layers in the model's dtype
    dtype = next((t.dtype for n, t in sorted(tensors.items()) if n.startswith(template) and t.is_floating_point()),
                 torch.float32)

    def noise(shape: tuple[int, ...], norm: bool = False) -> torch.Tensor:
        values = torch.randn(shape, generator=generator) * (0.1 if norm else scale)
        return (values + 1.0 if norm else values).to(dtype)

    written: list[str] = []
    for index in range(layers):
        glue_prefix, block_prefix = fmt.glue_prefix(config, index), fmt.block_prefix(config, index)
        for name in sorted(n for n in tensors if n.startswith(template)):
            new = block_prefix + name[len(template):]
            tensors[new] = noise(tuple(tensors[name].shape), name.endswith(("norm.weight", "layernorm.weight")))
            written.append(new)
        shapes = {"enorm": (hidden,), "hnorm": (hidden,), "proj": (hidden, 2 * hidden), "norm": (hidden,),
                  "embed": (vocab, hidden), "head": (vocab, hidden)}
        for role, name in fmt.glue.items():
            tensors[glue_prefix + name] = noise(shapes[role], role in ("enorm", "hnorm", "norm"))
            written.append(glue_prefix + name)
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw["num_nextn_predict_layers"] = layers
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return written
