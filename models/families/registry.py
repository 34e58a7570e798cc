"""The family registry: the one table of families kvforge knows, and the lookup of a config's family.

The table holds the hand-written families (plain data rows, a recipe each) and every family module of this
folder (a family that needs code: its `FAMILIES`, found here by walking the folder, so adding one is adding
its module). The coverage sweep's passing types (kvforge/data/coverage.json) join it as swept families,
with their module's hooks where they have one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.families import gpt2
from kvforge.models.families.family import Family

# The hand-written families: plain data, no I/O at import.
HAND_WRITTEN: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", ("LlamaForCausalLM",), "Llama 1-3.x incl. llama3 rope scaling, tied or untied embeddings",
               uniform_layers=True),
        Family("mistral", ("MistralForCausalLM",), "sliding-window attention",
               uniform_layers=True),
        Family("qwen2", ("Qwen2ForCausalLM",), "q/k/v bias, optional sliding window",
               uniform_layers=True),
        Family("qwen3", ("Qwen3ForCausalLM",), "q/k RMSNorm, head_dim independent of hidden/heads",
               uniform_layers=True),
        Family("phi3", ("Phi3ForCausalLM",), "Phi-3/3.5/4-mini: fused qkv and gate/up, LongRoPE, partial rotary",
               uniform_layers=True),
        Family("gemma", ("GemmaForCausalLM",), "embedding scaling, RMSNorm +1, GeGLU, head_dim 256",
               uniform_layers=True),
        Family("gemma2", ("Gemma2ForCausalLM",),
               "attention and final-logit soft-capping, query_pre_attn_scalar, alternating sliding/global layers",
               final_softcap_key="final_logit_softcapping"),
        Family("gemma3_text", ("Gemma3ForCausalLM",),
               "q/k norm, sliding/global layer pattern with their own RoPE bases (text model)",
               final_softcap_key="final_logit_softcapping"),
        gpt2.FAMILY,
        Family("olmo2", ("Olmo2ForCausalLM",), "post-norm blocks, q/k RMSNorm over all heads",
               uniform_layers=True),
        Family("granite", ("GraniteForCausalLM",), "embedding, residual, attention and logit multipliers",
               logits_divisor_key="logits_scaling",
               uniform_layers=True),
        Family("smollm3", ("SmolLM3ForCausalLM",), "layers without RoPE (NoPE) between rotary layers"),
    )
}


# Modules of this folder that hold no family.
_NOT_FAMILIES = {"family", "registry", "surgery", "state_binding", "qwen_vl_tower", "processor_settings"}


@functools.cache
def family_modules() -> Mapping[str, Family]:
    """model_type -> the family of a module in this folder (its hooks; a swept one's architecture comes from the
    coverage data): every module's FAMILIES, imported on the first call."""
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(_folder()):
        if info.name in _NOT_FAMILIES:
            continue
        module = importlib.import_module(f"kvforge.models.families.{info.name}")
        for family in module.FAMILIES:
            assert family.model_type not in found, f"{family.model_type} has two family modules"
            found[family.model_type] = family
    return MappingProxyType(found)


def _folder() -> list[str]:
    from kvforge.models import families as package

    return list(package.__path__)


def _swept_families() -> dict[str, Family]:
    """The types the coverage sweep passes on `ort` and `onnx` that have no hand-written family: the
    sweep checked them at parity with HF eager, so they export as their module's family (or a plain one)."""
    from kvforge.models.coverage_data import load_coverage

    own = family_modules()
    return {
        name: dataclasses.replace(own.get(name) or Family(name, (), ""), architectures=(row["architecture"],),
                                  notes="coverage sweep", **row.get("logit_keys", {}), swept=True,
                                  trt_refusal=row.get("trt_reason"))
        for name, row in load_coverage()["types"].items()
        if row["status"] == "pass" and name not in HAND_WRITTEN and "architecture" in row
    }


@functools.cache
def families() -> Mapping[str, Family]:
    """The registry: the hand-written families and the types the coverage sweep passes (its data file is
    read on the first call, not at import). Read-only: a caller that needs another registry (the sweep's
    trials) makes its own and passes it."""
    return MappingProxyType({**HAND_WRITTEN, **_swept_families()})


def trial_registry(model_type: str, architecture: str, config: Any = None) -> dict[str, Family]:
    """The coverage sweep's registry for trying a type: the registry with a plain Family for it. A
    hand-written family keeps its own; a swept one is tried afresh, so its recorded `trt` refusal does
    not refuse the re-run that might clear it."""
    registry = dict(families())
    if model_type not in HAND_WRITTEN:
        registry[model_type] = dataclasses.replace(
            family_modules().get(model_type) or Family(model_type, (), ""), architectures=(architecture,),
            notes="coverage sweep trial", swept=False, trt_refusal=None, **logit_keys(config))
    return registry


def own_text_type(model_type: Any) -> str | None:
    """The text model type of a multimodal type that is its own text config (its family's `text_config`)."""
    family = family_modules().get(model_type) if isinstance(model_type, str) else None
    return family.text_config if family is not None else None


# The config fields *ForCausalLM.forward reads to transform lm_head's output, by Family key (RecurrentGemma
# names its final softcap `logits_soft_cap`, xLSTM `output_logit_soft_cap`).
LOGIT_KEYS = {"final_softcap_key": ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"),
              "logits_divisor_key": ("logits_scaling",), "logits_multiplier_key": ("logit_scale",)}


def logit_keys(config: Any) -> dict[str, str]:
    """The Family logit keys a config has fields for (the first of a key's field names it has)."""
    found = {key: next((field for field in fields if hasattr(config, field)), None) for key, fields in LOGIT_KEYS.items()}
    return {key: field for key, field in found.items() if config is not None and field is not None}


def supported_architectures(registry: Mapping[str, Family] | None = None) -> list[str]:
    return sorted({arch for family in (registry or families()).values() for arch in family.architectures})


def family_for(config: Any, registry: Mapping[str, Family] | None = None) -> Family:
    """The family adapter for a transformers config (from `registry`, default: families()), or a clear
    error naming what is supported."""
    registry = registry if registry is not None else families()
    model_type = getattr(config, "model_type", None)
    architectures = getattr(config, "architectures", None) or []
    if isinstance(architectures, str):
        architectures = [architectures]
    # Not ~150 class names on one line: how many, and where they are listed.
    supported = f"{len(registry)} decoder-only model types, listed in docs/models.md"
    family = registry.get(model_type) if isinstance(model_type, str) else None
    if family is None and getattr(config, "is_encoder_decoder", False):
        from kvforge.models.encoder_decoders import ENCODER_DECODERS

        raise UnsupportedModelError(
            f"model_type {model_type!r} is an encoder-decoder model kvforge does not export yet: of those it exports "
            f"{', '.join(ENCODER_DECODERS)}; see docs/encoder-decoder.md")
    if family is None:
        named = f" ({', '.join(map(str, architectures))})" if architectures else ""
        claimed: dict[str, str] = {}
        for other in registry.values():  # hand-written families first: several swept types reuse their classes
            for arch in set(other.architectures) & set(architectures):
                claimed.setdefault(arch, other.model_type)
        if claimed:
            # transformers builds the model from model_type, so a supported class named in
            # `architectures` does not make this config one of that family: say so, not just "unsupported".
            arch, other = next(iter(claimed.items()))
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}{named}: config.json's model_type decides the model family "
                f"and it disagrees with its architectures, which names {arch} (model_type {other!r}); if the "
                f"model really is a {other} model, set \"model_type\": \"{other}\" in config.json. kvforge "
                f"supports {supported}"
            )
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}{named}{_why_not(model_type)}; kvforge supports {supported}"
        )
    if architectures and not set(architectures) & set(family.architectures):
        raise UnsupportedModelError(
            f"unsupported architecture {', '.join(map(str, architectures))} for model_type {model_type!r}; "
            f"kvforge supports {supported}"
        )
    return family


def _why_not(model_type: Any) -> str:
    """": the reason" the coverage sweep recorded for a type it does not pass (kvforge/data/coverage.json)."""
    from kvforge.models.coverage_data import load_coverage

    row = load_coverage()["types"].get(model_type) if isinstance(model_type, str) else None
    return f": {row['reason']}" if row and row.get("reason") else ""


def support_table() -> str:
    """The README's table of supported families x targets, generated from HAND_WRITTEN and the recipes
    (a test checks README against it, so the two cannot drift)."""
    from kvforge.core.targets import TARGETS
    from kvforge.models.recipes import FAMILY_RECIPES, RECIPES

    columns = " | ".join(f"`{name}`" for name in TARGETS)
    lines = [f"| Family (`model_type`) | Architecture | What it exercises | {columns} | Tiny recipes (parity-tested) |",
             "|---|---|---|" + "---|" * len(TARGETS) + "---|"]
    for family in HAND_WRITTEN.values():
        recipes = [f"`{name}`" for name in FAMILY_RECIPES if RECIPES[name].model_type == family.model_type]
        lines.append(f"| `{family.model_type}` | {', '.join(family.architectures)} | {family.notes} | "
                     + "✓ | " * len(TARGETS) + f"{', '.join(recipes)} |")
    lines += ["", "| Target | dtypes |", "|---|---|"]
    lines += [f"| `{target.name}` | {target.support} |" for target in TARGETS.values()]
    return "\n".join(lines)
