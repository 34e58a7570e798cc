"""The text model of a multimodal checkpoint: kvforge exports tokens in, logits out.

A multimodal checkpoint (`...ForConditionalGeneration`: Gemma 3, Mllama, Emu3, ...) holds a text decoder beside its
vision / audio towers: its config.json nests the decoder's config as `text_config`, its safetensors hold the
decoder under a prefix (`model.language_model.`, or the older `language_model.model.`) and `lm_head.`. kvforge
exports that text model: the causal-LM class transformers maps the text config's model_type to (Gemma3ForCausalLM
for gemma3_text), with its weights read from the checkpoint's language-model tensors alone: the towers are neither
built nor read. The loader (exporter/load.py) uses this module for the export and for parity's reference, so an
export and the Hugging Face model it is checked against are the same text model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError, UnsupportedModelError
from kvforge.models.families import Family, family_for, own_text_type

# Where checkpoints keep the text model's backbone (its `model.` in the causal-LM class) and its lm_head: transformers
# 5's layout, then the layouts older checkpoints were saved in, then a type that is its own text model.
BACKBONE_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "text_model.model.",
                     "model.")
HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.", "text_model.lm_head.")
_TEXT_OF = "kvforge_text_of"  # the attribute that marks a text config made here: the checkpoint it came from


def is_multimodal(model_type: Any) -> bool:
    """Whether a model_type is a multimodal checkpoint whose text model kvforge exports (transformers saves it from
    a multimodal LM class; the types that need their non-text inputs are out of scope)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    from kvforge.models.coverage_data import out_of_scope
    from kvforge.models.vision_families import vision_family

    return isinstance(model_type, str) and model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES \
        and (not out_of_scope(model_type) or vision_family(model_type) is not None)


def text_config_of(config: Any) -> Any:
    """The text model's config of a multimodal checkpoint's config (a copy; its `architectures` names the text
    causal-LM class and text_of() the checkpoint), or None for any other config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    from kvforge.models.vision_families import vision_family

    model_type = getattr(config, "model_type", None)
    if not is_multimodal(model_type) or text_of(config) is not None:
        return None
    text_type = own_text_type(model_type)  # a type that is its own text config (its family module says of what)
    if text_type is not None:
        fields = set(AutoConfig.for_model(text_type).to_dict()) - {"model_type", "architectures", "transformers_version"}
        text = AutoConfig.for_model(text_type, **{k: v for k, v in config.to_dict().items() if k in fields})
    elif getattr(config, "text_config", None) is not None:
        text = copy.deepcopy(config.text_config)
    else:
        return None
    vision = vision_family(model_type)
    for name, value in vision.text_overrides if vision is not None else ():  # what the whole model computes
        setattr(text, name, value)
    architecture = (getattr(config, "architectures", None) or [MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type]])[0]
    text.architectures = [_causal_lm_class(text, model_type, architecture).__name__]
    source: dict[str, Any] = {"model_type": model_type, "architecture": architecture}
    skipped = sorted(getattr(text, "cross_attention_layers", None) or [])
    if skipped:
        # Mllama: these layers attend to the image's states only, and a tokens-only forward skips them (HF's
        # text model runs them only with image states). The text model for tokens is the one without them.
        text.num_hidden_layers -= len(skipped)
        text.cross_attention_layers = []
        source["skipped_layers"] = skipped
    setattr(text, _TEXT_OF, source)
    return text


def text_of(config: Any) -> dict[str, Any] | None:
    """{"model_type", "architecture"} of the multimodal checkpoint a text config came from (text_config_of), and
    the checkpoint's `skipped_layers` where its text model for tokens leaves layers out; or None. The manifest
    records it as `model.text_of`."""
    source = getattr(config, _TEXT_OF, None)
    return dict(source) if isinstance(source, dict) else None


def _causal_lm_class(text: Any, model_type: str, architecture: str) -> type:
    """transformers' causal-LM class for a text config: the checkpoint family's own (its `text_class`), else the one
    its model_type maps to, else the one the checkpoint's type maps to when that class is made for this config
    (Emu3ForCausalLM for emu3_text_model)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from kvforge.models.families import family_modules

    own = family_modules().get(model_type)
    if own is not None and own.text_class is not None:  # transformers ships the text model without a head
        return own.text_class(text)
    for key in (text.model_type, model_type):
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(key, ""), None)
        if cls is not None and (key == text.model_type or getattr(cls, "config_class", None) is type(text)):
            return cls
    raise UnsupportedModelError(f"{model_type}: a multimodal checkpoint ({architecture}) whose text model type "
                                f"{text.model_type!r} has no causal-LM class in transformers "
                                f"{transformers.__version__}; kvforge exports causal LMs")


def text_family(config: Any, registry: Mapping[str, Family] | None = None) -> Family:
    """The family adapter for a config (family_for), a multimodal checkpoint's text config included: its text
    type's family, or, for a text type that is no causal-LM type of its own (emu3_text_model,
    mllama_text_model: the coverage sweep checks it inside its checkpoint), the checkpoint type's. A text model
    kvforge does not support is refused in one line naming it and the reason the coverage sweep recorded."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from kvforge.models.families import families

    source = text_of(config)
    if source is None:
        return family_for(config, registry)
    registry = registry if registry is not None else families()
    wrapper, text_type = source["model_type"], config.model_type
    own_type = text_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # it has a coverage row of its own
    if text_type not in registry and not own_type and wrapper in registry:
        return dataclasses.replace(registry[wrapper], model_type=text_type, architectures=tuple(config.architectures))
    try:
        return family_for(config, registry)
    except UnsupportedModelError as err:
        from kvforge.models.coverage_data import load_coverage

        row = load_coverage()["types"].get(text_type if own_type or text_type in registry else wrapper) or {}
        reason = row.get("reason") or " ".join(str(err).split())
        raise UnsupportedModelError(
            f"{wrapper}: a multimodal checkpoint ({source['architecture']}); kvforge exports its text model, "
            f"{text_type} ({config.architectures[0]}), which it refuses: {reason}") from None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(model_dir.glob("*.safetensors"))


def load_text_model(model_dir: str | Path, dtype: str = "fp32", config: Any = None) -> Any:
    """A multimodal checkpoint folder's text model with its eager attention, in eval mode: the causal-LM class of
    `config` (default: text_config_of the folder's config), its weights the checkpoint's language-model tensors
    renamed (BACKBONE_PREFIXES -> `model.`, HEAD_PREFIXES -> `lm_head.`; no lm_head: tied to the embedding), read
    with safetensors one by one; no tower is built and no tower tensor read."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    from kvforge.core.contract import DTYPES

    model_dir = Path(model_dir)
    if config is None:
        config = text_config_of(AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False))
        if config is None:
            raise InputError(f"{model_dir} is not a multimodal checkpoint (its config.json has no text model)")
    config = copy.deepcopy(config)
    files = {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), "pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    cls, wanted, prefix, head = text_tensor_names(config, files)
    if prefix is None:
        raise InputError(f"{model_dir}: no text-model tensors under {', '.join(BACKBONE_PREFIXES)} in its safetensors; "
                         "pass a complete Hugging Face checkpoint")
    config.tie_word_embeddings = not head  # a checkpoint without lm_head tensors ties it to the embedding
    state = {}
    for file in sorted(set(files.values())):
        names = {new: old for new, old in wanted.items() if files[old] == file}
        if names:
            with safe_open(str(file), "pt") as handle:
                state.update({new: handle.get_tensor(old) for new, old in names.items()})
    model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=getattr(torch, DTYPES[dtype]),
                                      attn_implementation="eager", output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise InputError(f"{model_dir}'s text model lacks {len(missing)} tensors ({', '.join(missing[:3])}, ...) "
                         f"under {prefix}; the checkpoint is incomplete or laid out in a way kvforge does not know")
    return model.eval()


def text_tensor_names(config: Any, names: Iterable[str]) -> tuple[type, dict[str, str], str | None, bool]:
    """Where a multimodal checkpoint's text model lies among its tensor `names`: the causal-LM class of `config` (a
    text_config_of config), {the class's parameter name: the checkpoint's tensor name} (BACKBONE_PREFIXES ->
    the class's backbone, HEAD_PREFIXES -> `lm_head.`, the layers text_of's skipped_layers leaves out dropped and
    the others renumbered), the backbone prefix found (None: no text-model tensor) and whether an lm_head is stored
    (none: tied to the embedding). Nothing is read but the names."""
    import torch

    names = list(names)
    source = text_of(config) or {}
    cls = _causal_lm_class(config, source.get("model_type", config.model_type), source.get("architecture", ""))
    with torch.device("meta"):  # the class's module names, nothing allocated
        skeleton = cls._from_config(copy.deepcopy(config))
    backbone = next(name for name, _ in skeleton.named_children() if name != "lm_head")
    parts = {name for name, _ in getattr(skeleton, backbone).named_children()}

    def ours(name: str, prefix: str) -> bool:
        return name.startswith(prefix) and name[len(prefix):].split(".")[0] in parts

    prefix = next((p for p in BACKBONE_PREFIXES if any(ours(name, p) for name in names)), None)
    if prefix is None:
        return cls, {}, None, False
    skipped = set(source.get("skipped_layers", ()))
    kept = [i for i in range(config.num_hidden_layers + len(skipped)) if i not in skipped]
    renumber = {str(old): str(new) for new, old in enumerate(kept)}
    wanted = {}
    for name in names:
        if ours(name, prefix):
            rest = name[len(prefix):].split(".")
            if rest[0] == "layers" and skipped:
                if rest[1] not in renumber:
                    continue
                rest[1] = renumber[rest[1]]
            wanted[".".join([backbone, *rest])] = name
    head = next((p for p in HEAD_PREFIXES if f"{p}weight" in set(names)), None)
    if head is not None:
        wanted.update({f"lm_head.{name[len(head):]}": name for name in names if name.startswith(head)})
    return cls, wanted, prefix, head is not None
