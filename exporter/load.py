"""Loading a local Hugging Face folder for export: the config (family checked first), the weights
(safetensors only), the model with its eager attention (also the parity reference)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

from kvforge.core.contract import DTYPES
from kvforge.core.errors import InputError, KvforgeError
from kvforge.exporter.text_model import load_text_model, text_config_of, text_family, text_of
from kvforge.models.checkpoint_names import refuse_incomplete
from kvforge.models.families import Family, family_for, own_text_type
from kvforge.models.hub import HUB_ID

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def check_model_path(path: str | Path, gguf: bool = True) -> None:
    """What is wrong with a model path, said before torch loads (seconds): it does not exist (a Hub id is
    named as one: ids are resolved before, by kvforge.models.hub), it is a file but not a .gguf, or a folder without config.json.
    `gguf`: whether a .gguf file, or a folder holding one, is a model here (export) or not (parity)."""
    given = str(path)
    path = Path(path)
    wanted = "a local Hugging Face model folder or a .gguf file" if gguf else "a local Hugging Face model folder"
    if not path.exists():
        if HUB_ID.fullmatch(given):
            raise InputError(
                f"{given} does not exist here; it looks like a Hugging Face Hub id, and this reads local folders "
                f"only: pass it to `kvforge export`/`parity` (or export_model), which take Hub ids from the Hugging Face "
                f"cache (kvforge.models.hub), or download it first (`hf download {given} --local-dir "
                f"{given.split('/')[1]}`) and pass that folder"
            )
        raise InputError(f"{path} does not exist; pass {wanted} (kvforge downloads nothing)")
    if path.is_file():
        if gguf and path.suffix.lower() == ".gguf":
            return
        what = "a file but not a .gguf file" if gguf else "a file, not a folder"
        raise InputError(f"{path} is {what}; pass {wanted.replace('folder', 'folder (with config.json)', 1)}")
    if not path.is_dir():
        raise InputError(f"{path} is neither a file nor a folder; pass {wanted}")
    if (path / "config.json").is_file():
        return
    if gguf and any(p.suffix.lower() == ".gguf" for p in path.iterdir()):
        return  # a GGUF source (kvforge.models.gguf.find_gguf picks the one file)
    nor = " (nor a folder with one .gguf file)" if gguf else ""
    raise InputError(f"{path} has no config.json: not a Hugging Face model folder{nor}; pass the folder that "
                     "holds config.json")


def load_hf_config(model_dir: str | Path, families: Mapping[str, Family] | None = None):
    """AutoConfig for a local HF folder, with errors that say what is wrong. The family is checked
    on the raw config.json first, so an unknown model_type is named as such. A multimodal checkpoint gives
    its text model's config (exporter/text_model.py), checked against the registry as that text model."""
    model_dir = Path(model_dir)
    check_model_path(model_dir, gguf=False)
    config_file = model_dir / "config.json"
    try:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{config_file} is not valid JSON ({one_line(err)}); fix or re-save the model folder") from err
    if not isinstance(raw, dict):
        raise InputError(f"{config_file} holds a JSON {type(raw).__name__}, not an object: not a model config")
    raw_family = SimpleNamespace(model_type=raw.get("model_type"), architectures=raw.get("architectures"),
                                 is_encoder_decoder=raw.get("is_encoder_decoder", False))
    # A multimodal checkpoint is checked as its text model (once transformers has read its config).
    multimodal = isinstance(raw.get("text_config"), dict) or own_text_type(raw.get("model_type")) is not None
    if not multimodal:
        family_for(raw_family, families)
    # Only after the cheap checks: transformers (and torch) take seconds to load.
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as err:  # AttributeError: a derived field set
        if multimodal:
            family_for(raw_family, families)  # a type transformers does not know: named as unsupported
        raise InputError(f"{config_file} could not be read by transformers: {one_line(err)}") from err
    text = text_config_of(config) if multimodal else None
    if text is None:
        if multimodal:  # a text_config, but not a multimodal checkpoint kvforge exports the text model of
            family_for(raw_family, families)
        return config
    text_family(text, families)
    return text


def check_weight_files(model_dir: Path) -> None:
    """kvforge reads safetensors only: pickle checkpoints can run code when loaded."""
    if any(model_dir.glob("*.safetensors")) or (model_dir / "model.safetensors.index.json").is_file():
        return
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InputError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}); kvforge loads safetensors only, "
            "because unpickling can run code: convert them (e.g. load in transformers and save_pretrained "
            "with safe_serialization=True) and export again"
        )
    raise InputError(f"{model_dir} has no weights (*.safetensors); pass a complete Hugging Face model folder")


def load_hf_model(model_dir: str | Path, dtype: str = "fp32", families: Mapping[str, Family] | None = None,
                  gap: str | None = None):
    """The local HF model with its eager attention, in eval mode (also the parity reference). `families`:
    the family registry to check it against (default: kvforge.models.families.families()). A tensor the model
    needs that the checkpoint lacks, one it has no place for, or one of another shape is refused in one line.
    `gap`: the line a streamed export would have refused the checkpoint with (a tensor missing by its name or
    shape), said instead of transformers' own error should it fail to load the folder (it is the real reason)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    config = load_hf_config(model_dir, families)
    text_family(config, families)
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_weight_files(model_dir)
    # kvforge prints its own progress: transformers' bar is off for this load only, so an application
    # that embeds the exporter keeps its own setting.
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    # Its loading report (a table of missing tensors) is refused below in one line, not printed.
    hf_logging.set_verbosity_error()
    try:
        if text_of(config) is not None:  # a multimodal checkpoint: its text model, from its language-model tensors
            model = load_text_model(model_dir, dtype, config)
        else:
            # A tensor missing, unexpected or of another shape is refused, never filled with random values.
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="eager", local_files_only=True,
                use_safetensors=True, trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True,
            )
            refuse_incomplete(model_dir, model, info)
    except KvforgeError:
        raise
    except Exception as err:  # safetensors, transformers and torch each raise their own types
        if gap is not None:
            raise InputError(f"{gap} (transformers cannot load the folder whole either: {one_line(err)[:160]})") from err
        raise InputError(
            f"could not load the weights of {model_dir}: {type(err).__name__}: {one_line(err)}; "
            "the files may be truncated or corrupted"
        ) from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()
