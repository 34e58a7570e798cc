"""A pre-quantised checkpoint's dequantised twin: the Hugging Face folder kvforge traces and compares against.

transformers loads GPTQ, AWQ and AutoRound checkpoints only through their libraries' GPU kernels, so the
export traces a plain fp32 folder instead: each quantised layer's weight is scale * (q - zero) in fp32
(the same numbers the checkpoint's integers stand for), the other tensors widened to fp32, the config
without its quantization_config. It is also the reference `kvforge parity` holds the export to. The
graph's MatMulNBits are packed from the checkpoint's own integers (kvforge.exporter.quantization.prequantized), never
from this folder. Made once per checkpoint (the marker records its files) and reused.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk
from kvforge.exporter.quantization.prequantized import (
    MARKER,
    Layout,
    PrequantizedWeights,
    layout_of,
    read_quantization_config,
)

SHARD_BYTES = 5 * 10**9
# The tensors a quantised layer stores in place of its weight (all formats kvforge takes).
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale", ".weight_zero_point",
         ".weight_shape", ".weight_g_idx")


def prequantized_layout(model_dir: Path) -> Layout | None:
    """The checkpoint's layout when its config says it is quantised (refused in one line when kvforge does not
    take the format), None for an ordinary checkpoint."""
    quant = read_quantization_config(model_dir)
    return None if quant is None else layout_of(quant, str(model_dir))


def _fingerprint(model_dir: Path) -> list[list[Any]]:
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(model_dir.glob("*.safetensors"))] + \
        [["config.json", (model_dir / "config.json").stat().st_size, int((model_dir / "config.json").stat().st_mtime)]]


class _Planned:
    def __init__(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        self.name, self.shape, self.make = name, shape, make
        self.numel = int(np.prod(shape)) if shape else 1
        self.nbytes = self.numel * 4

    @staticmethod
    def blocks(entry: _Planned) -> list[np.ndarray]:
        return [np.ascontiguousarray(entry.make(), dtype=np.float32).reshape(entry.shape)]


def convert_prequantized(model_dir: str | Path, hf_dir: str | Path, say: Callable[[str], None],
                         weights: PrequantizedWeights) -> Path:
    """The dequantised folder of the pre-quantised checkpoint `model_dir` in `hf_dir` (made, or reused while
    the checkpoint is unchanged), from its integers `weights` (read once by the export: source.py)."""
    model_dir, hf_dir = Path(model_dir).resolve(), Path(hf_dir).absolute()
    layout = weights.layout
    record = {"source": str(model_dir), "format": layout.kind, "packing": layout.packing, "bits": layout.bits,
              "group_size": layout.group_size, "files": _fingerprint(model_dir)}
    marker = hf_dir / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("files") == record["files"]:
                say(f"reusing {hf_dir} (dequantised from this {layout.kind} checkpoint before)")
                return hf_dir
        except ValueError:
            pass
    check_output(hf_dir, [model_dir], force=True, marker=MARKER, what="kvforge dequantised-checkpoint folder")
    say(f"{model_dir.name} is {layout.article} {layout.describe()} checkpoint: its {len(weights.prefixes)} quantised layers are "
        f"carried into MatMulNBits as they are; tracing reads their fp32 values from {hf_dir}")
    with (naming_a_full_disk(hf_dir, "choose another --hf-dir"),
          StagedFolder(hf_dir, MARKER, what="kvforge dequantised-checkpoint folder", sources=[model_dir],
                       say=say) as staged):
        assert staged.path is not None
        _write(model_dir, staged.path, weights)
        (staged.path / MARKER).write_text(json.dumps({**record, "layers": len(weights.prefixes)}, indent=2) + "\n")
        staged.publish()
    return hf_dir


def _write(model_dir: Path, out: Path, weights: PrequantizedWeights) -> None:
    from safetensors import safe_open

    from kvforge.models.safetensors_shards import write_checkpoint

    plan: list[_Planned] = []
    for name in sorted(weights.files):
        if any(name.endswith(part) for part in PARTS) and name.rsplit(".", 1)[0] in weights.prefixes:
            continue
        with safe_open(str(weights.files[name]), "pt") as handle:
            shape = tuple(handle.get_slice(name).get_shape())
        # A model's weights and biases are floats (an int32 or bool one is corrupt); other tensors pass as they are
        role = "float" if name.endswith((".weight", ".bias")) else "any"
        plan.append(_Planned(name, shape, lambda name=name, role=role: weights.tensor(name, role)))
    for name in weights.weight_names():
        rows, cols = weights.load(name).shape  # (read again when written: one layer held at a time)
        plan.append(_Planned(name, (rows, cols), lambda name=name: weights.load(name).dequantized()))
    write_checkpoint(out, plan, "F32", _Planned.blocks, SHARD_BYTES)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", "quantization_config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy2(file, out / file.name)


def dequantised_twin(model_dir: Path, manifest: dict[str, Any], say: Callable[[str], None]) -> Path:
    """A pre-quantised checkpoint (GPTQ, AWQ, ...) is compared through its dequantised twin, the folder its
    export traced (transformers loads the checkpoint itself only through its library's GPU kernels)."""
    if read_quantization_config(model_dir) is None:
        return model_dir
    twin = Path(manifest["model"].get("source", ""))
    try:
        source = json.loads((twin / MARKER).read_text())["source"]
    except (OSError, ValueError, KeyError):
        source = None
    if source is None or Path(source).resolve() != model_dir.resolve():
        raise InputError(f"{model_dir} is a pre-quantised checkpoint, and {twin} (the folder the export traced) is not "
                         "its dequantised twin: pass the folder `kvforge export` dequantised it into")
    say(f"comparing against {twin}, the dequantised twin of {model_dir.name} (its integers in fp32)")
    return twin
