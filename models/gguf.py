"""GGUF in: a `.gguf` file (or a folder holding one) -> an ordinary Hugging Face folder, cached.

transformers reads GGUF files (`from_pretrained(folder, gguf_file=...)`, with the `gguf` package) and
dequantises the weights to fp32. It refuses `save_pretrained` on such a model, so the model is rebuilt
from its config without the quantisation entry and given the loaded weights, then saved as
safetensors with the tokenizer (chat template included) and the generation config. The folder
carries `kvforge_gguf.json` (the source file, its size and sha256, its architecture and tensor
types); a later conversion of the same file reuses it.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError, UnsupportedModelError
from kvforge.core.manifest import sha256_file
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk
from kvforge.models.families import families

GGUF_MARKER = "kvforge_gguf.json"
GGUF_MAGIC = b"GGUF"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a folder that is not already a
    Hugging Face folder (no config.json). None when `path` is not a GGUF source."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(files) > 1:
            raise InputError(f"{path} holds {len(files)} .gguf files ({', '.join(p.name for p in files)}); pass one")
        if files:
            return files[0]
    return None


def read_header(path: Path) -> dict[str, Any]:
    """Architecture and tensor types of a GGUF file, or a one-line error if it is not a readable GGUF."""
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise InputError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model file")
    try:
        import gguf
    except ImportError as err:
        raise InputError("reading GGUF files needs the gguf package: pip install 'kvforge[export]'") from err
    try:
        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
        types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    except Exception as err:  # gguf raises ValueError / IndexError / KeyError on damaged files
        raise InputError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); it may be truncated") from err
    return {"architecture": architecture, "tensor_types": dict(sorted(types.items()))}


def _check_supported(path: Path, header: dict[str, Any]) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = header["architecture"]
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{path} is a GGUF of architecture {arch!r}, which transformers cannot read")
    if arch not in families():
        raise UnsupportedModelError(
            f"{path} is a GGUF of architecture {arch!r}; kvforge exports {', '.join(sorted(families()))}"
        )


def convert_gguf(
    gguf_path: str | Path, hf_dir: str | Path, progress: Callable[[str], None] | None = None
) -> Path:
    """Convert (or reuse the conversion of) a GGUF file into the Hugging Face folder `hf_dir`."""
    say = progress or (lambda _msg: None)
    gguf_path, hf_dir = Path(gguf_path).resolve(), Path(hf_dir).absolute()
    if not gguf_path.is_file():
        raise InputError(f"{gguf_path} is not a file")
    header = read_header(gguf_path)
    _check_supported(gguf_path, header)
    digest = sha256_file(gguf_path)
    marker = hf_dir / GGUF_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("sha256") == digest:
                say(f"reusing {hf_dir} (converted from this GGUF before)")
                return hf_dir
        except ValueError:
            pass
    check_output(hf_dir, [gguf_path], force=True, marker=GGUF_MARKER, what="kvforge GGUF conversion folder")
    say(f"converting {gguf_path.name} ({header['architecture']}, {', '.join(header['tensor_types'])}) "
        f"to a Hugging Face folder in {hf_dir}")
    # transformers and safetensors report a full disk without a path (or with the hidden staging file's).
    with (naming_a_full_disk(hf_dir, "choose another --hf-dir"),
          StagedFolder(hf_dir, GGUF_MARKER, what="kvforge GGUF conversion folder", sources=[gguf_path],
                       say=say) as staged):
        staging = staged.path
        assert staging is not None
        _convert(gguf_path, staging)
        record = {"source": str(gguf_path), "bytes": gguf_path.stat().st_size, "sha256": digest, **header}
        (staging / GGUF_MARKER).write_text(json.dumps(record, indent=2) + "\n")
        staged.publish()
    return hf_dir


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    # transformers' GGUF reader draws its own tqdm bar per tensor; kvforge reports progress itself.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    saved_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # an architecture or quantisation type transformers' GGUF loader cannot read
        raise UnsupportedModelError(
            f"transformers cannot read {gguf_path.name}: {type(err).__name__}: {' '.join(str(err).split())}"
        ) from err
    finally:
        gguf_utils.tqdm = saved_tqdm
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild it without the
    # quantisation entry and hand it the dequantised weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    if loaded.generation_config is not None:
        generation = loaded.generation_config
    generation.save_pretrained(out)
