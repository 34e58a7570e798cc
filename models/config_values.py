"""Reading a transformers config's fields where some are set per layer (transformers' heterogeneous configs)."""

from __future__ import annotations

from typing import Any


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """`config.name`, or layer 0's value where the config sets it per layer (transformers refuses the global
    read of such a field: Gemma 4's head_dim). Only for first guesses: the export probes each layer's shapes."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return getattr(config.per_layer_config[0], name, default)
