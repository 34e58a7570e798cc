"""One adapter per supported architecture family: what the exporter needs to know beyond HF's code.

HF's own modules still compute embeddings, projections, norms, RoPE and positions; kvforge only
replaces the attention kernel (HF hands it the per-layer scale, sliding window and softcap). So an
adapter is small: which architectures belong to the family, what happens to the logits after
`lm_head` (it runs outside HF's backbone, so the family says), and which of its options kvforge
cannot export.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.config_values import config_value

# Rotary variants whose tables HF computes from the positions alone, so they trace into the graph.
# ("longrope" picks its short or long table from the largest position of the call, with torch.where.)
# "dynamic" NTK scaling re-computes its frequencies in Python from the longest sequence seen so far.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


@dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]
    notes: str
    # Post-lm_head logit transforms, read from the config (0 / 1 = off): Gemma 2/3 soft-cap the
    # final logits, Granite divides them by `logits_scaling`.
    final_softcap_key: str | None = None
    logits_divisor_key: str | None = None
    logits_multiplier_key: str | None = None  # Cohere: logits * logit_scale
    # Registered by the coverage sweep (kvforge/data/coverage.json), not by hand with a recipe; and
    # why its `trt` export fails there, if it does.
    swept: bool = False
    trt_refusal: str | None = None
    # Decoder layers alike by construction (no sliding/full alternation, no layers without rotary, no
    # dense-then-MoE): a streamed export traces two and stamps the rest (exporter/layer_stamping.py).
    uniform_layers: bool = False

    # First guesses from the config (the export probes the shapes each layer really has); 1 for a model
    # without attention heads (a state-space model), which keeps no KV.
    def head_dim(self, config: Any) -> int:  # latent attention's keys: qk_head_dim (nope + rope dims)
        heads = config_value(config, "num_attention_heads")
        return config_value(config, "qk_head_dim") or config_value(config, "head_dim") or (
            config.hidden_size // heads if heads else 1)

    def kv_heads(self, config: Any) -> int:  # GPT-2: plain MHA
        return config_value(config, "num_key_value_heads") or config_value(config, "num_attention_heads") or 1

    def final_softcap(self, config: Any) -> float:
        return float(getattr(config, self.final_softcap_key, None) or 0.0) if self.final_softcap_key else 0.0

    def logits_divisor(self, config: Any) -> float:
        return float(getattr(config, self.logits_divisor_key, None) or 1.0) if self.logits_divisor_key else 1.0

    def logits_multiplier(self, config: Any) -> float:
        return float(getattr(config, self.logits_multiplier_key, None) or 1.0) if self.logits_multiplier_key else 1.0

    def finish_logits(self, config: Any, logits: Any) -> Any:
        """What the family's *ForCausalLM.forward does to lm_head's output (torch, in the graph)."""
        multiplier = self.logits_multiplier(config)
        if multiplier != 1.0:
            logits = logits * multiplier
        divisor = self.logits_divisor(config)
        if divisor != 1.0:
            logits = logits / divisor
        cap = self.final_softcap(config)
        if cap > 0.0:
            logits = (logits / cap).tanh() * cap
        return logits

    def check(self, config: Any) -> None:
        """Options of a supported family that kvforge cannot export: fail naming the option."""
        for where, params in _rope_parameter_sets(config):
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"{self.model_type}: rope type {rope_type!r}{where} is not supported; kvforge exports "
                    f"rope types {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        # "vision" (Gemma 4 unified) is bidirectional over image tokens only, which a tokens-only export never has.
        bidirectional = getattr(config, "use_bidirectional_attention", False)
        if bidirectional and bidirectional != "vision":
            raise UnsupportedModelError(f"{self.model_type}: use_bidirectional_attention={bidirectional!r} is not "
                                        "supported (kvforge exports causal decoders)")
        if self.model_type == "gpt2" and (getattr(config, "scale_attn_by_inverse_layer_idx", False)
                                          or getattr(config, "reorder_and_upcast_attn", False)):
            raise UnsupportedModelError("gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")


def _rope_parameter_sets(config: Any) -> list[tuple[str, dict[str, Any]]]:
    """(where, parameters) for each RoPE configuration of the model: one, or one per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [(f" (layer type {name})", value) for name, value in params.items() if isinstance(value, dict)]
    return nested or [("", params)]


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
        Family("gpt2", ("GPT2LMHeadModel",), "learned absolute positions, multi-head attention, biases, LayerNorm"),
        Family("olmo2", ("Olmo2ForCausalLM",), "post-norm blocks, q/k RMSNorm over all heads",
               uniform_layers=True),
        Family("granite", ("GraniteForCausalLM",), "embedding, residual, attention and logit multipliers",
               logits_divisor_key="logits_scaling",
               uniform_layers=True),
        Family("smollm3", ("SmolLM3ForCausalLM",), "layers without RoPE (NoPE) between rotary layers"),
    )
}


def _swept_families() -> dict[str, Family]:
    """The types the coverage sweep passes on `ort` and `onnx` that have no hand-written family: the
    sweep checked them at parity with HF eager, so they export as plain families."""
    from kvforge.models.coverage import load_coverage

    return {
        name: Family(name, (row["architecture"],), "coverage sweep", **row.get("logit_keys", {}), swept=True,
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
        registry[model_type] = Family(model_type, (architecture,), "coverage sweep trial", **logit_keys(config))
    return registry


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
        raise UnsupportedModelError(
            f"model_type {model_type!r} is an encoder-decoder model, out of kvforge's scope: it exports decoder-only "
            f"causal language models (prefill and decode of one stack); see docs/models.md for the {len(registry)} "
            "it takes")
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
    from kvforge.models.coverage import load_coverage

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
