"""Which model a parity run holds an export to: MODEL_DIR must be the model the export was made from (its config
against the manifest's record and the config.json the export copied), or the run would fail in numpy, or blame the
export for another model's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError


def check_same_model(model_dir: Path, manifest: dict[str, Any], export_dir: Path) -> None:
    """Refuse a MODEL_DIR that is not the model the export was made from (its config against the manifest's
    record, then its shape against the config.json the export copied): a parity run against another model fails
    in numpy, or blames the export."""
    if not (model_dir / "config.json").is_file():
        return  # load_hf_model says what is wrong with the folder
    from transformers import AutoConfig

    from kvforge.models.config_values import config_value

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - an unreadable config: load_hf_model says so in its words
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    recorded = dict(manifest["model"])
    if (recorded.get("text_of") or {}).get("model_type") == config.model_type:
        # A multimodal checkpoint that is its own text config (Phi-4-multimodal): the export records its text type.
        recorded.pop("model_type", None)
    theirs = {"model_type": {config.model_type, text.model_type}, "vocab_size": config_value(text, "vocab_size"),
              "hidden_size": config_value(text, "hidden_size"), "num_heads": config_value(text, "num_attention_heads")}
    differ = [f"{name} {recorded[name]} in the export, {value if name != 'model_type' else text.model_type} in "
              f"{model_dir.name}" for name, value in theirs.items()
              if recorded.get(name) is not None and value is not None
              and (recorded[name] not in value if name == "model_type" else recorded[name] != value)]
    differ += _other_shape(text, export_dir, model_dir.name) if not differ else []
    if differ:
        source = recorded.get("source")
        raise InputError(f"{model_dir} is not the model {export_dir} was exported from ({'; '.join(differ)})"
                         + (f"; it was exported from {source}" if source else "") + ". The order is MODEL_DIR "
                         "EXPORT_DIR")


# The config fields that set a model's shape: a model of the same type and width but another depth, MLP or
# head layout is another model (compared with the config.json the export copied from its source).
SHAPE_FIELDS = ("num_hidden_layers", "intermediate_size", "num_key_value_heads", "head_dim", "hidden_size",
                "num_attention_heads", "vocab_size", "num_local_experts", "num_experts", "moe_intermediate_size")


def _other_shape(text: Any, export_dir: Path, folder: str) -> list[str]:
    """How the text config `text` differs in shape from the config.json the export copied from its source."""
    from transformers import AutoConfig

    from kvforge.models.config_values import config_value

    try:
        exported = AutoConfig.from_pretrained(export_dir)
    except Exception:  # noqa: BLE001 - no config.json in the export (or an unreadable one): the manifest's fields only
        return []
    exported = exported.get_text_config() if hasattr(exported, "get_text_config") else exported
    differ = []
    for field in SHAPE_FIELDS:
        ours, theirs = config_value(exported, field), config_value(text, field)
        if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
            differ.append(f"{field} {ours} in the export, {theirs} in {folder}")
    return differ
