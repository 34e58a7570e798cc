"""Loading a local Hugging Face folder for export: the config (family checked first), the weights
(safetensors only), the model with its eager attention (also the parity reference)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

from kvforge.core.contract import DTYPES
from kvforge.core.errors import InputError
from kvforge.models.families import Family, family_for

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def load_hf_config(model_dir: str | Path, families: Mapping[str, Family] | None = None):
    """AutoConfig for a local HF folder, with errors that say what is wrong. The family is checked
    on the raw config.json first, so an unknown model_type is named as such."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"{model_dir} is not a folder; pass a local Hugging Face model folder")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{config_file} is not valid JSON ({one_line(err)}); fix or re-save the model folder") from err
    if not isinstance(raw, dict):
        raise InputError(f"{config_file} holds a JSON {type(raw).__name__}, not an object: not a model config")
    family_for(SimpleNamespace(model_type=raw.get("model_type"), architectures=raw.get("architectures")), families)
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise InputError(f"{config_file} could not be read by transformers: {one_line(err)}") from err


def _check_weight_files(model_dir: Path) -> None:
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


def load_hf_model(model_dir: str | Path, dtype: str = "fp32", families: Mapping[str, Family] | None = None):
    """The local HF model with its eager attention, in eval mode (also the parity reference). `families`:
    the family registry to check it against (default: kvforge.models.families.families())."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    config = load_hf_config(model_dir, families)
    family_for(config, families)
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    _check_weight_files(model_dir)
    # kvforge prints its own progress: transformers' bar is off for this load only, so an application
    # that embeds the exporter keeps its own setting.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="eager", local_files_only=True,
            use_safetensors=True, trust_remote_code=False,
        )
    except Exception as err:  # safetensors, transformers and torch each raise their own types
        raise InputError(
            f"could not load the weights of {model_dir}: {type(err).__name__}: {one_line(err)}; "
            "the files may be truncated or corrupted"
        ) from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()
