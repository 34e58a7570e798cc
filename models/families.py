"""One adapter per supported architecture family: what the exporter needs to know beyond HF's code.

HF's own modules still compute q/k/v, norms and RoPE; kvforge only replaces the attention kernel,
so an adapter is small: which architectures belong to the family and how to read the attention
attributes the fused node carries (sliding window, logit softcap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]
    notes: str

    def head_dim(self, config: Any) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def softcap(self, config: Any) -> float:
        return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", ("LlamaForCausalLM",), "Llama 1-3.x incl. llama3 rope scaling, tied or untied embeddings"),
        Family("mistral", ("MistralForCausalLM",), "sliding-window attention"),
        Family("qwen2", ("Qwen2ForCausalLM",), "q/k/v bias, optional sliding window"),
        Family("qwen3", ("Qwen3ForCausalLM",), "q/k RMSNorm, head_dim independent of hidden/heads"),
    )
}


def supported_architectures() -> list[str]:
    return sorted(arch for family in FAMILIES.values() for arch in family.architectures)


def family_for(config: Any) -> Family:
    """The family adapter for a transformers config, or a clear error naming what is supported."""
    model_type = getattr(config, "model_type", None)
    architectures = getattr(config, "architectures", None) or []
    if isinstance(architectures, str):
        architectures = [architectures]
    supported = ", ".join(supported_architectures())
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        named = f" ({', '.join(map(str, architectures))})" if architectures else ""
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}{named}; kvforge supports {supported}"
        )
    if architectures and not set(architectures) & set(family.architectures):
        raise UnsupportedModelError(
            f"unsupported architecture {', '.join(map(str, architectures))} for model_type {model_type!r}; "
            f"kvforge supports {supported}"
        )
    return family
