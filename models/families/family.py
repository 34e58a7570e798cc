"""A model family: what kvforge knows about one Hugging Face `model_type` beyond HF's own code.

HF's modules still compute embeddings, projections, norms, RoPE and positions; kvforge replaces the attention
kernel (HF hands it the per-layer scale, sliding window and softcap). Most families are plain data: their
architectures, what happens to the logits after `lm_head` (it runs outside HF's backbone, so the family says).
A family that needs code has a module of its own in this folder and fills the hooks below; each hook is asked
by exactly one stage of the export:

    refuse        loading (Family.check)        an option of the family kvforge cannot export
    text_config   loading (exporter/text_model)  a multimodal type that is its own text config: the text type
    text_class    loading (exporter/text_model)  the causal-LM class of a text model transformers ships none for
    mrope         tracing (exporter/wrapper)     three rotary position streams: prefill takes position_ids
    capacity      the KV layout (exporter/graphs) the most positions an export holds exactly, and why
    patch         after loading (exporter/graphs) put attention where kvforge reaches it, on the export's Patches
    states        probing and tracing            a recurrent state outside transformers' cache: probe / bind
    looped_experts  probing (exporter/experts_routing)  read experts written as a loop into the MoE node's layout
    rotary_dims   KV-cache calibration           how many leading channels of a head RoPE rotates
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvforge.core.errors import UnsupportedModelError
from kvforge.models.config_values import config_value

if TYPE_CHECKING:  # state_binding imports torch; this module is imported without it
    from kvforge.models.families.state_binding import FamilyStates

# Rotary variants whose tables HF computes from the positions alone, so they trace into the graph.
# ("longrope" picks its short or long table from the largest position of the call, with torch.where.)
# "dynamic" NTK scaling re-computes its frequencies in Python from the longest sequence seen so far.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


class LoopedExperts(NamedTuple):
    """An experts module's weights in the MoE node's layout: gate [E, I, H], up [E, I, H], down [E, H, I]; how many
    identity experts follow the routed ones (output = input); the activation; the module's own parameters the node
    replaces, as (owner, name); and whether it returns [batch, -1, H] rather than its input's shape."""

    gate: Any
    up: Any
    down: Any
    identity: int
    activation: Any
    parameters: tuple[tuple[Any, str], ...]
    batch_first: bool = False


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
    # The hooks (the module docstring says which stage asks each).
    refuse: Callable[[Any], str | None] | None = None
    text_config: str | None = None
    capacity: Callable[[Any], tuple[int, str] | None] | None = None
    patch: Callable[[Any, Any], str] | None = None
    patch_keeps_weights: bool = False  # the patch changes code only: a streamed export may run it on fake weights
    states: FamilyStates | None = None
    looped_experts: Callable[[Any], LoopedExperts | None] | None = None
    rotary_dims: Callable[[Any, int], int] | None = None
    text_class: Callable[[Any], type] | None = None
    # Multimodal rotary positions (Qwen2-VL's M-RoPE: temporal, height, width): a whole-model export's prefill takes
    # contract.POSITION_IDS and its decode contract.ROPE_DELTAS; its text-only export keeps past_lens + t.
    mrope: bool = False

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

    def rotary(self, config: Any, head_dim: int) -> int:
        """How many leading channels of a head RoPE rotates (0 for a family with learned positions)."""
        if self.rotary_dims is not None:
            return self.rotary_dims(config, head_dim)
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
        return int(head_dim * factor) // 2 * 2

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
        reason = self.refuse(config) if self.refuse is not None else None
        if reason:
            raise UnsupportedModelError(reason)


def _rope_parameter_sets(config: Any) -> list[tuple[str, dict[str, Any]]]:
    """(where, parameters) for each RoPE configuration of the model: one, or one per layer type."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [(f" (layer type {name})", value) for name, value in params.items() if isinstance(value, dict)]
    return nested or [("", params)]
