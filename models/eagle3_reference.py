"""A plain torch reference of the published EAGLE-3 head (CPU, fp32), for parity tests of draft.onnx.

Written by kvforge from the EAGLE-3 paper (arXiv 2503.01840) and the published code it was checked against, not
copied: SafeAILab/EAGLE eagle/model/cnets.py (`LlamaDecoderLayeremb`, `Model.forward`, `topK_genrate`) and
vllm-project/speculators (`Eagle3SpeculatorConfig`, its decoder layer's `norm_before_residual`). Nothing here uses
kvforge's attention op or transformers' modules: attention is an explicit masked softmax over an explicit cache,
RoPE is computed from the layer config's rope_theta (transformers' rope initialisation only for a scaled rope type).

One call (`Eagle3Reference.step`) runs the head over S new positions per row, given:
- input_ids [B, S]: at head position p, the token p + 1 (cnets.py drops the first token: `input_ids[:, 1:]`);
- target_hidden [B, S, n*Ht]: the target's aux layer states at p (models/eagle3.py: inputs of those layers),
  or None; draft_hidden [B, S, H]: the head's own previous hidden_out, or None. The layer's input hidden state is
  fc(target_hidden) + draft_hidden (fc is bias-free: cnets.py applies fc only to target states, 3H wide, and feeds
  its own H-wide outputs back unchanged, which is the sum with the other term zero);
- its KV cache, positions past_lens[b] + t: RoPE at that position (cnets.py: position_ids = arange from the cached
  length), causal over the row's cache.
It returns logits [B, S, Vd] (lm_head(norm(h))) and hidden_out [B, S, H] (h, before the final norm).

The layer (cnets.py LlamaDecoderLayeremb): residual = h (speculators' norm_before_residual: hidden_norm(h));
x = cat(input_layernorm(embed(ids)), hidden_norm(h)); h = residual + o_proj(attn(q, k, v of x));
h = h + mlp(post_attention_layernorm(h)).
"""

from __future__ import annotations

from typing import Any

import torch

from kvforge.models.eagle3 import Eagle3Head


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _inv_freq(head: Eagle3Head) -> tuple[torch.Tensor, float]:
    """The layer's RoPE inverse frequencies and attention scaling: the default rope from rope_theta, else
    transformers' initialisation of the config's rope type (llama3, yarn, ...)."""
    config = head.llama_config()
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return 1.0 / theta ** (torch.arange(0, head.head_dim, 2, dtype=torch.float32) / head.head_dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(scaling)


class Eagle3Reference:
    """The head with its KV cache ([B, H_kv, capacity, D] key and value, per-row `past_lens`)."""

    def __init__(self, head: Eagle3Head, embedding: torch.Tensor, batch: int, capacity: int) -> None:
        """`embedding` [V, H]: the head's own embed_tokens where it has one, else the target's."""
        self.head, self.w = head, head.weights
        self.embedding = head.weights.get("embed_tokens.weight", embedding).float()
        self.eps = float(head.layer_config.get("rms_norm_eps", 1e-6))
        self.inv_freq, self.rope_scale = _inv_freq(head)
        shape = (batch, head.num_kv_heads, capacity, head.head_dim)
        self.key, self.value = torch.zeros(shape), torch.zeros(shape)
        self.past_lens = torch.zeros(batch, dtype=torch.int64)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, S, D] rotated at positions [B, S] (half-split rotation, as Llama)."""
        angles = positions[:, None, :, None].float() * self.inv_freq[None, None, None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1) * self.rope_scale
        sin = torch.cat([angles.sin(), angles.sin()], -1) * self.rope_scale
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        head, (batch, seq, _) = self.head, x.shape
        split = (batch, seq, -1, head.head_dim)
        q = self._linear(x, "layer.self_attn.q_proj").view(split).transpose(1, 2)
        k = self._linear(x, "layer.self_attn.k_proj").view(split).transpose(1, 2)
        v = self._linear(x, "layer.self_attn.v_proj").view(split).transpose(1, 2)
        positions = self.past_lens[:, None] + torch.arange(seq)[None]
        q, k = self._rope(q, positions), self._rope(k, positions)
        group = head.num_heads // head.num_kv_heads
        out = torch.zeros(batch, head.num_heads, seq, head.head_dim)
        for b in range(batch):
            start = int(self.past_lens[b])
            self.key[b, :, start:start + seq], self.value[b, :, start:start + seq] = k[b], v[b]
            keys = self.key[b, :, :start + seq].repeat_interleave(group, 0)
            values = self.value[b, :, :start + seq].repeat_interleave(group, 0)
            scores = q[b] @ keys.transpose(-1, -2) * head.head_dim ** -0.5  # [heads, S, T]
            allowed = torch.arange(start + seq)[None, :] <= (start + torch.arange(seq))[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[b] = scores.softmax(-1) @ values
        self.past_lens += seq
        return self._linear(out.transpose(1, 2).reshape(batch, seq, -1), "layer.self_attn.o_proj")

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, target_hidden: torch.Tensor | None,
             draft_hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, S, Vd], hidden_out [B, S, H]) for S new positions of every row; the cache advances by S."""
        w, eps = self.w, self.eps
        batch, seq = input_ids.shape
        h = torch.zeros(batch, seq, self.head.hidden_size)
        if target_hidden is not None:
            h = h + torch.nn.functional.linear(target_hidden.float(), w["fc.weight"])
        if draft_hidden is not None:
            h = h + draft_hidden.float()
        normed = _rms(h, w["layer.hidden_norm.weight"], eps)
        residual = normed if self.head.norm_before_residual else h
        embeds = _rms(self.embedding[input_ids], w["layer.input_layernorm.weight"], eps)
        h = residual + self._attention(torch.cat([embeds, normed], -1))
        x = _rms(h, w["layer.post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(self._linear(x, "layer.mlp.gate_proj"))
        h = h + self._linear(gate * self._linear(x, "layer.mlp.up_proj"), "layer.mlp.down_proj")
        logits = torch.nn.functional.linear(_rms(h, w["norm.weight"], eps), w["lm_head.weight"])
        return logits, h


def target_aux_states(model: Any, input_ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The reference TARGET_HIDDEN of a Hugging Face model over whole sequences: its `output_hidden_states` at
    `layer_ids` (the inputs of those layers; index 0 is the embeddings), concatenated in layer order."""
    with torch.no_grad():
        states = model(input_ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in sorted(layer_ids)], -1)
