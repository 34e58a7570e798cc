"""GGUF in: a `.gguf` file (or a folder holding one) -> an ordinary Hugging Face folder, cached.

transformers reads the GGUF's config and tokenizer (with the `gguf` package). The weights are converted
tensor by tensor: each GGUF tensor is dequantised to fp32, given transformers' own processing and name
(Llama's q/k rows un-permuted), and streamed into safetensors shards (models/safetensors_shards.py), so
converting holds one tensor, not the model. The result is the folder transformers' whole-model GGUF
loading and `save_pretrained` would write (a test compares every tensor). Architectures whose tensors are
not one parameter each (merged experts) load the whole model through transformers, as before, saying so.
The folder carries `kvforge_gguf.json` (the source file, its size and sha256, its architecture and tensor
types); a later conversion of the same file reuses it.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.errors import InputError, UnsupportedModelError
from kvforge.core.manifest import sha256_file
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk
from kvforge.models.checkpoint_names import GGUF_MARKER  # noqa: F401  (a conversion's record, named here too)
from kvforge.models.families import families

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
        raise InputError("reading GGUF files needs the gguf package: pip install -e '.[export]'") from err
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
    marker = hf_dir / GGUF_MARKER
    if marker.is_file():  # the check hashes the whole file: said first, so a slow disk's wait has a name
        say(f"checking {hf_dir} against {gguf_path.name} (hashing its {gguf_path.stat().st_size / 1e6:.0f} MB)")
    digest = sha256_file(gguf_path)
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
        _convert(gguf_path, staging, say)
        record = {"source": str(gguf_path), "bytes": gguf_path.stat().st_size, "sha256": digest, **header}
        (staging / GGUF_MARKER).write_text(json.dumps(record, indent=2) + "\n")
        staged.publish()
    return hf_dir


# Architectures whose transformers tensor processor maps each GGUF tensor to one parameter of the same
# name, from its own values alone: these convert tensor by tensor. The rest (experts merged across
# tensors, renamed or split tensors) load the whole model through transformers, as before.
_STREAMED_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor")
_SHARD_BYTES = 5 * 10**9


def _convert(gguf_path: Path, out: Path, say: Callable[[str], None]) -> None:
    """The Hugging Face folder of `gguf_path` in `out`: tokenizer, config, generation config, and the
    weights dequantised to fp32, streamed tensor by tensor where the architecture allows it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config_dict = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    except Exception as err:  # an architecture transformers' GGUF reader cannot read
        raise _unreadable(gguf_path, err) from err
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.architectures = [type(empty).__name__]
    config.dtype = torch.float32
    plan = tensor_plan(gguf_path, empty)
    if isinstance(plan, str):
        say(f"loading the whole GGUF model through transformers: {plan}")
        _convert_whole(gguf_path, out, config)
    else:
        config.save_pretrained(out)
        from kvforge.models.safetensors_shards import write_checkpoint

        write_checkpoint(out, plan, "F32", _GGUFTensor.blocks, _SHARD_BYTES)
    # The tokenizer after the weights: building it takes seconds to a minute, and a corrupt or missing tensor
    # is refused before that.
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as err:  # a tokenizer transformers' GGUF reader cannot read
        raise _unreadable(gguf_path, err) from err
    tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _unreadable(gguf_path: Path, err: Exception) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"transformers cannot read {gguf_path.name}: {type(err).__name__}: {' '.join(str(err).split())}")


class _GGUFTensor:
    """One parameter's GGUF tensor: dequantised and processed (Llama's q/k rows un-permuted) when written."""

    def __init__(self, name: str, shape: tuple[int, ...], tensor: Any, processor: Any, mapping: dict[str, str]) -> None:
        self.name, self.shape, self.tensor, self.processor, self.mapping = name, shape, tensor, processor, mapping
        self.numel = int(np.prod(shape)) if shape else 1
        self.nbytes = self.numel * 4

    @staticmethod
    def blocks(entry: _GGUFTensor) -> list[np.ndarray]:
        from gguf import dequantize

        from kvforge.models.gguf_checks import finite, float_type

        float_type(entry.tensor)
        try:
            weights = dequantize(entry.tensor.data, entry.tensor.tensor_type)
        except NotImplementedError as err:  # a block type gguf-py cannot dequantise
            raise InputError(f"GGUF tensor {entry.tensor.name} is of type {entry.tensor.tensor_type.name}, which the gguf "
                             f"package cannot dequantise ({err}): update it (pip install -U gguf)") from None
        finite(entry.tensor.name, "values", weights)  # a NaN scale inside a block dequantises to NaN weights
        result = entry.processor.process(weights=weights, name=entry.tensor.name, tensor_key_mapping=entry.mapping,
                                         parsed_parameters={})
        if result.name != entry.tensor.name or np.size(result.weights) != entry.numel:
            raise RuntimeError(f"GGUF tensor {entry.tensor.name} became {result.name} of {np.shape(result.weights)}, "
                               f"not {entry.name} of {list(entry.shape)}")
        return [np.asarray(result.weights, dtype=np.float32).reshape(entry.shape)]


def tensor_plan(gguf_path: Path, empty: Any) -> list[_GGUFTensor] | str:
    """Each parameter save_pretrained would write, with the GGUF tensor it comes from; or why the file
    cannot be converted tensor by tensor."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    processor_class = TENSOR_PROCESSORS.get(read_header(gguf_path)["architecture"])
    if processor_class is not None and processor_class.__name__ not in _STREAMED_PROCESSORS:
        return f"its tensors ({processor_class.__name__}) are not one parameter each"
    processor = (processor_class or TensorProcessor)(config=parsed.get("config", {}))
    mapping = get_gguf_hf_weights_map(empty, processor)
    wanted = dict(empty.state_dict())
    tied = getattr(empty.config, "tie_word_embeddings", False) and "lm_head.weight" in wanted
    if tied:
        wanted.pop("lm_head.weight")  # save_pretrained writes a tied lm_head once, as the embedding
    plan = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        hf_name = mapping.get(tensor.name)
        if hf_name in wanted and hf_name not in plan:
            plan[hf_name] = _GGUFTensor(hf_name, tuple(wanted[hf_name].shape), tensor, processor, mapping)
    missing = [name for name in wanted if name not in plan]
    if missing:
        return f"{len(missing)} of its parameters have no GGUF tensor of their own ({', '.join(missing[:3])})"
    return [plan[name] for name in wanted]


def _convert_whole(gguf_path: Path, out: Path, config: Any) -> None:
    """transformers' own GGUF loading (the whole model, in fp32), then save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from kvforge.models.checkpoint_names import refuse_incomplete

    # transformers' GGUF reader draws its own tqdm bar per tensor; kvforge reports progress itself.
    saved_tqdm, verbosity = gguf_utils.tqdm, hf_logging.get_verbosity()
    gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
    hf_logging.set_verbosity_error()  # its loading report: a missing tensor is refused below in one line
    try:
        loaded, info = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=torch.float32, output_loading_info=True)
    except Exception as err:  # a quantisation type transformers' GGUF loader cannot read
        raise UnsupportedModelError(
            f"transformers cannot read {gguf_path.name}: {type(err).__name__}: {' '.join(str(err).split())}"
        ) from err
    finally:
        gguf_utils.tqdm = saved_tqdm
        hf_logging.set_verbosity(verbosity)
    # A parameter no GGUF tensor gives would be written with random values. (A GGUF tensor transformers does not
    # map, such as llama.cpp's rope_freqs, is dropped as transformers' own GGUF loading drops it.)
    refuse_incomplete(gguf_path, loaded, {**info, "unexpected_keys": ()})
    # transformers refuses save_pretrained on a GGUF-loaded model: a model rebuilt from the config
    # without the quantisation entry is handed the dequantised weights.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
