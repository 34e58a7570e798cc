"""Multi-token-prediction (MTP) layers that checkpoints ship beside the model, which transformers drops at load:
where each family keeps them, how they are read and checked from the safetensors, and the one-layer model config
their decoder block runs in.

An MTP layer (DeepSeek-V3 technical report, section 2.2) predicts token p + 2 at position p from the target's
hidden state at p and the embedding of token p + 1:

    h' = proj(cat(norm_e(embed(t[p+1])), norm_h(h[p])))      (the order of the two halves is the family's)
    h'' = decoder_block(h')                                   (a normal decoder layer: attention, MLP / MoE, norms)
    logits = head(norm_out(h''))

Conventions, from the published serving code (vLLM's deepseek_mtp.py, glm4_moe_mtp.py, qwen3_next_mtp.py; SGLang's
deepseek_nextn.py), recorded in the manifest's draft record (`convention`):
- h[p] is the target's final *normed* hidden state (vLLM's and SGLang's DeepseekV2Model / Glm4MoeModel /
  Qwen3NextModel return `self.norm(...)`, and that output is what the proposer hands the MTP layer).
- DeepSeek-V3 and GLM-4.5: cat([enorm(embedding), hnorm(hidden)]) then eh_proj, embedding first; logits from
  shared_head.norm then shared_head.head. Qwen3-Next: cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]), fc,
  final mtp.norm, the target's lm_head. (MiMo, not handled here, puts the hidden state first.)
- `hidden_out`, what a chained step reads: DeepSeek-V3 / GLM-4.5 the block's output before shared_head.norm (vLLM's
  layer returns residual + block output; the norm is applied for the logits only); Qwen3-Next after mtp.norm (vLLM's
  predictor returns the normed state, which compute_logits and the next step read). The contract's default is the
  former; the record's `convention.hidden_out` says which.
- vLLM zeroes the embedding at position 0 ("masking inputs at position 0, as not needed by MTP"); SGLang and the
  technical report do not. kvforge follows the report: no masking.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.core.errors import InputError

# The glue tensors of one MTP layer, by role. "embed" and "head" may be absent: they are shared with the target's
# (its embedding, its lm_head), as vLLM loads them ("MTP modules share the embedding layer").
ROLES = ("enorm", "hnorm", "proj", "norm", "embed", "head")
SHARED_FALLBACK = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}


@dataclass(frozen=True)
class MtpFormat:
    """Where a family keeps its MTP layers and how it composes them."""

    model_types: tuple[str, ...]
    glue: dict[str, str]  # role -> tensor name inside the layer's glue prefix
    glue_prefix: Callable[[Any, int], str]  # (config, MTP layer index) -> prefix of its glue tensors
    block_prefix: Callable[[Any, int], str]  # (config, MTP layer index) -> prefix of its decoder block's tensors
    classes: tuple[str, str, str]  # the modeling module's decoder layer, rotary embedding and RMSNorm classes
    embedding_first: bool = True
    # The head model's config (one decoder layer, which must be the MTP block's kind: MoE, full attention)
    one_layer: Callable[[Any], dict[str, Any]] = lambda config: {}
    source: str = ""
    # What the layer hands the next chained step (and `hidden_out` is): the block's output before the final norm
    # (DeepSeek-V3, GLM-4.5: vLLM's layer returns residual + block output, shared_head.norm is applied for logits
    # only) or after it (Qwen3-Next: vLLM's predictor returns self.norm(...), which both the logits and the next
    # step read)
    hidden_out_normed: bool = False
    # The reference builds the block at its checkpoint index (num_hidden_layers + i) where the config's per-layer
    # fields allow it; False: in the one-layer config (Qwen3-Next's layer_types has no entry past the target's)
    own_index: bool = True


def _after_target(config: Any, index: int) -> str:
    return f"model.layers.{config.num_hidden_layers + index}."


_DEEPSEEK_GLUE = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "proj": "eh_proj.weight",
                  "norm": "shared_head.norm.weight", "embed": "embed_tokens.weight", "head": "shared_head.head.weight"}

FORMATS: dict[str, MtpFormat] = {
    "deepseek_v3": MtpFormat(
        ("deepseek_v3",), _DEEPSEEK_GLUE, _after_target, _after_target,
        ("DeepseekV3DecoderLayer", "DeepseekV3RotaryEmbedding", "DeepseekV3RMSNorm"),
        one_layer=lambda config: {"first_k_dense_replace": 0},  # layer num_hidden_layers >= first_k_dense: MoE
        source="vllm/model_executor/models/deepseek_mtp.py; sglang/srt/models/deepseek_nextn.py"),
    "glm4_moe": MtpFormat(
        ("glm4_moe",), _DEEPSEEK_GLUE, _after_target, _after_target,
        ("Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding", "Glm4MoeRMSNorm"),
        one_layer=lambda config: {"first_k_dense_replace": 0},
        source="vllm/model_executor/models/glm4_moe_mtp.py"),
    "qwen3_next": MtpFormat(
        ("qwen3_next",),
        {"enorm": "pre_fc_norm_embedding.weight", "hnorm": "pre_fc_norm_hidden.weight", "proj": "fc.weight",
         "norm": "norm.weight"},
        lambda config, index: "mtp.", lambda config, index: f"mtp.layers.{index}.",
        ("Qwen3NextDecoderLayer", "Qwen3NextRotaryEmbedding", "Qwen3NextRMSNorm"),
        one_layer=lambda config: {"layer_types": ["full_attention"], "mlp_only_layers": [], "decoder_sparse_step": 1},
        source="vllm/model_executor/models/qwen3_next_mtp.py", hidden_out_normed=True, own_index=False),
}


def mtp_format(config: Any) -> MtpFormat | None:
    """The MTP format of the config's family, or None where kvforge knows none."""
    return FORMATS.get(getattr(config, "model_type", None))


def mtp_layer_count(config: Any) -> int:
    """How many MTP layers the config declares (num_nextn_predict_layers; 0 when it names none)."""
    value = getattr(config, "num_nextn_predict_layers", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass
class MtpWeights:
    """One MTP layer read from the checkpoint: its glue tensors by role (and where each came from) and its decoder
    block's tensors, named as in a one-layer model (`model.layers.0.*`)."""

    index: int
    glue: dict[str, Any]
    sources: dict[str, str]
    block: dict[str, Any]
    block_prefix: str


def shipped(config: Any, names: Any) -> bool:
    """Whether the checkpoint (its tensor names) holds any tensor of the config's first MTP layer."""
    fmt = mtp_format(config)
    if fmt is None or not mtp_layer_count(config):
        return False
    prefixes = (fmt.glue_prefix(config, 0), fmt.block_prefix(config, 0))
    return any(name.startswith(prefixes) for name in names)


def read_mtp_layer(config: Any, checkpoint: Any, index: int = 0) -> MtpWeights:
    """The MTP layer `index` of the checkpoint (exporter/checkpoint.py's Checkpoint), its glue tensors checked for
    presence and shape: InputError, in one line, for a missing or misshaped one."""
    fmt = mtp_format(config)
    if fmt is None:
        raise InputError(f"{config.model_type}: kvforge knows no MTP layer format for it")
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    expected = {"enorm": (hidden,), "hnorm": (hidden,), "proj": (hidden, 2 * hidden), "norm": (hidden,),
                "embed": (vocab, hidden), "head": (vocab, hidden)}
    where = f"{checkpoint.model_dir}: MTP layer {index}"
    prefix = fmt.glue_prefix(config, index)
    glue, sources = {}, {}
    for role in ROLES:
        name = prefix + fmt.glue[role] if role in fmt.glue else None
        if (name is None or name not in checkpoint) and role in SHARED_FALLBACK:
            name = SHARED_FALLBACK[role]  # shared with the target (vLLM loads it so)
        if name is None or name not in checkpoint:
            raise InputError(f"{where} lacks {name or role}; the checkpoint's MTP layer is incomplete (export with "
                             "--no-mtp to leave it out)")
        shape = tuple(checkpoint.info(name).shape)
        if shape != expected[role]:
            raise InputError(f"{where}: {name} has shape {list(shape)}, not {list(expected[role])} (hidden "
                             f"{hidden}, vocabulary {vocab}); export with --no-mtp to leave it out")
        glue[role], sources[role] = checkpoint.read(name), name
    block_prefix = fmt.block_prefix(config, index)
    glue_names = {prefix + name for name in fmt.glue.values()}
    block = {"model.layers.0." + name[len(block_prefix):]: checkpoint.read(name) for name in checkpoint.names
             if name.startswith(block_prefix) and name not in glue_names}
    if not block:
        raise InputError(f"{where} has no decoder block tensors ({block_prefix}*); export with --no-mtp to leave it "
                         "out")
    return MtpWeights(index, glue, sources, block, block_prefix)


def one_layer_config(config: Any) -> Any:
    """The config of a one-layer model of the family whose layer 0 is the MTP block's kind (MoE, full attention):
    the model the exporter runs the block in. No MTP layers of its own, untied head."""
    fmt = mtp_format(config)
    assert fmt is not None
    head = copy.deepcopy(config)
    head.num_hidden_layers = 1
    head.num_nextn_predict_layers = 0
    head.tie_word_embeddings = False
    for key, value in fmt.one_layer(config).items():
        setattr(head, key, value)
    return head


def modeling_classes(config: Any) -> tuple[type, type, type]:
    """The family's decoder layer, rotary embedding and RMSNorm classes (its transformers modeling module)."""
    import importlib

    fmt = mtp_format(config)
    assert fmt is not None
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return tuple(getattr(module, name) for name in fmt.classes)  # type: ignore[return-value]


def convention(config: Any) -> dict[str, Any]:
    """The manifest's record of how the head composes its inputs (see the module docstring for the sources)."""
    fmt = mtp_format(config)
    assert fmt is not None
    return {"target_hidden": "final_normed", "concat": "embedding_first" if fmt.embedding_first else "hidden_first",
            "hidden_out": "after_final_norm" if fmt.hidden_out_normed else "before_final_norm",
            "position0_embedding": "kept", "source": fmt.source}


def mtp_tensor_pattern(config: Any) -> str | None:
    """A regular expression matching the checkpoint names of the config's declared MTP layers (which transformers'
    model has no place for), or None where it declares none or kvforge knows no format for its family."""
    import re

    fmt = mtp_format(config) if config is not None else None
    if fmt is None or not mtp_layer_count(config):
        return None
    prefixes = {fmt.glue_prefix(config, i) for i in range(mtp_layer_count(config))}
    prefixes |= {fmt.block_prefix(config, i) for i in range(mtp_layer_count(config))}
    return "^(" + "|".join(re.escape(prefix) for prefix in sorted(prefixes)) + ")"
