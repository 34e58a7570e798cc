"""Random-weight EAGLE-3 heads for a target folder, in either published form (models/eagle3.py), for tests and
demos: config.json + model.safetensors with seeded weights, a draft vocabulary smaller than the target's (d2t /
t2d over a seeded subset of the target's ids). THE WEIGHTS ARE RANDOM: the drafts are noise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError
from kvforge.models.eagle3 import LAYER_PREFIXES


def _layer_config(target: dict[str, Any], heads: int, kv_heads: int, intermediate: int) -> dict[str, Any]:
    """The head layer's Llama config: the target's hidden size and RoPE, the given heads and MLP width."""
    hidden = int(target["hidden_size"])
    config = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": intermediate,
              "hidden_act": "silu", "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
              "max_position_embeddings": int(target.get("max_position_embeddings", 2048)),
              "num_hidden_layers": 1, "vocab_size": int(target["vocab_size"]), "attention_bias": False}
    rope = target.get("rope_parameters") or {}
    config["rope_theta"] = float(rope.get("rope_theta", target.get("rope_theta", 10000.0)))
    return config


def write_random_head(target_dir: str | Path, out_dir: str | Path, *, form: str = "speculators",
                      draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None, seed: int = 0,
                      norm_before_residual: bool = False, heads: int = 4, kv_heads: int = 2,
                      intermediate_size: int = 128, scale: float = 0.2) -> Path:
    """Write a head for the target in `target_dir` (its config.json) to `out_dir`. `form`: "speculators" (its
    config with the layer under transformer_layer_config, weights layers.0.*) or "eagle" (EAGLE's config,
    weights midlayer.*). `aux_layer_ids` None: speculators' form writes EAGLE's default, (2, L // 2, L - 3), while
    EAGLE's form leaves them out (the reader applies that default)."""
    import torch
    from safetensors.torch import save_file

    if form not in LAYER_PREFIXES:
        raise InputError(f"unknown head form {form!r}: {' or '.join(LAYER_PREFIXES)}")
    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = {**target.get("text_config", {}), **target}
    hidden, vocab, layers = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])
    draft_vocab = draft_vocab_size or max(2, vocab // 4)
    ids = list(aux_layer_ids) if aux_layer_ids is not None else sorted({2, layers // 2, layers - 3})
    layer = _layer_config(target, heads, kv_heads, intermediate_size)
    head_dim = layer["head_dim"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def gain(size: int) -> torch.Tensor:  # norm gains near 1, not exactly 1, so a swapped norm is seen
        return 1.0 + normal(size, std=0.1)

    prefix = LAYER_PREFIXES[form]
    weights = {
        "fc.weight": normal(hidden, len(ids) * hidden, std=scale / len(ids) ** 0.5),
        f"{prefix}input_layernorm.weight": gain(hidden), f"{prefix}hidden_norm.weight": gain(hidden),
        f"{prefix}post_attention_layernorm.weight": gain(hidden),
        f"{prefix}self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        f"{prefix}self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": normal(intermediate_size, hidden),
        f"{prefix}mlp.up_proj.weight": normal(intermediate_size, hidden),
        f"{prefix}mlp.down_proj.weight": normal(hidden, intermediate_size),
        "norm.weight": gain(hidden), "lm_head.weight": normal(draft_vocab, hidden, std=1.0),
    }
    kept = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values  # the draft's target ids
    weights["d2t"] = (kept - torch.arange(draft_vocab)).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    weights["t2d"] = t2d
    if form == "speculators":
        config: dict[str, Any] = {
            "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
            "norm_before_residual": norm_before_residual, "target_hidden_size": hidden,
            "eagle_aux_hidden_state_layer_ids": ids}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
        if aux_layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = ids
        if norm_before_residual:
            config["norm_before_residual"] = True
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
