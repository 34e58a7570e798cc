"""What a checkpoint folder says about its Hugging Face Processor (the class that writes an image's text into a
prompt): processor_config.json's own settings and the tokenizer's named tokens, each with the class's default where
the folder is silent. A tiled vision family's `prompt_record` reads them (models/vision_families.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not readable JSON ({err}); fix or remove it") from None
    return value if isinstance(value, dict) else {}


def processor_settings(model_dir: Path, defaults: dict[str, Any]) -> dict[str, Any]:
    """`defaults` (the Processor class's own) overridden by processor_config.json's values of the same names."""
    saved = _json(Path(model_dir) / "processor_config.json")
    return {name: saved.get(name, value) for name, value in defaults.items()}


def tokenizer_names(model_dir: Path, defaults: dict[str, str]) -> dict[str, str]:
    """The tokens a Processor reads off its tokenizer by name (InternVL's start_image_token, ...): tokenizer_config.json's
    `extra_special_tokens` (or a top-level entry) where it names one, else `defaults`."""
    config = _json(Path(model_dir) / "tokenizer_config.json")
    extra = config.get("extra_special_tokens")
    extra = extra if isinstance(extra, dict) else {}
    out = {}
    for name, value in defaults.items():
        found = extra.get(name, config.get(name))
        out[name] = found if isinstance(found, str) and found else value
    return out
