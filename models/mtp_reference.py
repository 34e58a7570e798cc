"""A torch reference of a checkpoint's MTP layer, for checking draft.onnx (tests/exporter/test_mtp_export.py).

Written from the published serving code, not from kvforge's exporter: the glue follows vLLM's
DeepSeekMultiTokenPredictorLayer.forward (vllm/model_executor/models/deepseek_mtp.py; glm4_moe_mtp.py is the same,
qwen3_next_mtp.py names the parts fc / pre_fc_norm_*) and SGLang's deepseek_nextn.py:

    h' = eh_proj(cat([enorm(embed_tokens(t[p+1])), hnorm(h[p])]))
    h'' = mtp_block(h')                 (the family's decoder layer; returns residual + output)
    logits = shared_head.head(shared_head.norm(h''))
    hidden_out = h''                    (Qwen3-Next: mtp.norm(h''), what its predictor returns and chains)

(without vLLM's zeroing of position 0's embedding: models/mtp.py says why). Every weight is read by its
checkpoint name with safetensors; the decoder block is transformers' class of the family (its published HF
implementation) at the MTP layer's own index, eager attention over the whole sequence with a causal mask and no
cache, its experts stacked from the checkpoint's per-expert tensors here. The exporter instead loads the block
through transformers' loader into a one-layer model and runs it a chunk at a time over kvforge's KV cache.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _stack_experts(block: dict[str, Any]) -> dict[str, Any]:
    """Per-expert checkpoint tensors as transformers' fused expert parameters (gate_up_proj [E, 2I, H], gate
    first, and down_proj [E, H, I]); every other tensor as it is."""
    import torch

    experts: dict[int, dict[str, Any]] = {}
    out = {}
    for name, tensor in block.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(int(match[1]), {})[match[2]] = tensor
        else:
            out[name] = tensor
    if experts:
        order = sorted(experts)
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in order])
        out["mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


class MtpReference:
    """The checkpoint's MTP layer `index`: `forward(tokens, hidden)` -> (logits [S, V], hidden_out [S, H]) for one
    row, where tokens[p] is token p + 1 and hidden[p] the hidden state given at p (the target's, or the head's own
    previous output), positions 0 .. S - 1."""

    def __init__(self, model_dir: str | Path, index: int = 0) -> None:
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig

        from kvforge.models.mtp import SHARED_FALLBACK, modeling_classes, mtp_format, one_layer_config

        self.config = config = AutoConfig.from_pretrained(model_dir)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # the block runs standalone, outside a model that would set it
        fmt = mtp_format(config)
        assert fmt is not None, config.model_type
        tensors: dict[str, Any] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
        glue_prefix, block_prefix = fmt.glue_prefix(config, index), fmt.block_prefix(config, index)
        self.glue = {role: tensors.get(glue_prefix + name) for role, name in fmt.glue.items()}
        for role, shared in SHARED_FALLBACK.items():
            if self.glue.get(role) is None:
                self.glue[role] = tensors[shared]
        glue_names = {glue_prefix + name for name in fmt.glue.values()}
        block = {name[len(block_prefix):]: t for name, t in tensors.items()
                 if name.startswith(block_prefix) and name not in glue_names}
        layer_class, rotary_class, norm_class = modeling_classes(config)
        if fmt.own_index:  # the block as the checkpoint places it (its MoE-or-dense choice by its own index)
            self.block = layer_class(config, layer_idx=config.num_hidden_layers + index).eval()
        else:  # per-layer config lists end at the target's layers: the one-layer config (full attention, MoE)
            layer_config = one_layer_config(config)
            layer_config._attn_implementation = layer_config._experts_implementation = "eager"
            self.block = layer_class(layer_config, layer_idx=0).eval()
        self.block.load_state_dict(_stack_experts(block), strict=True)
        self.rotary = rotary_class(config=config)
        eps = config.rms_norm_eps
        self.norms = {}
        for role in ("enorm", "hnorm", "norm"):
            norm = norm_class(config.hidden_size, eps=eps)
            norm.load_state_dict({"weight": self.glue[role]})
            self.norms[role] = norm.eval()
        self.embedding_first, self.normed_out = fmt.embedding_first, fmt.hidden_out_normed
        self.torch = torch

    def forward(self, tokens: Any, hidden: Any) -> tuple[Any, Any]:
        torch = self.torch
        with torch.no_grad():
            tokens = torch.as_tensor(tokens, dtype=torch.int64)[None]
            hidden = torch.as_tensor(hidden, dtype=torch.float32)[None]
            embedded = self.norms["enorm"](torch.nn.functional.embedding(tokens, self.glue["embed"]))
            normed = self.norms["hnorm"](hidden)
            parts = [embedded, normed] if self.embedding_first else [normed, embedded]
            x = torch.nn.functional.linear(torch.cat(parts, -1), self.glue["proj"])
            seq = x.shape[1]
            positions = torch.arange(seq)[None]
            mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
            out = self.block(x, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            normed = self.norms["norm"](out)
            logits = torch.nn.functional.linear(normed, self.glue["head"])
            return logits[0].numpy(), (normed if self.normed_out else out)[0].numpy()
