"""The coverage sweep's tiny configs: the fields it shrinks (SMALL) and what some types need besides (sizes tied
to other fields, defaults that do not build, one layer of each kind where the kinds follow from other fields).
Plain data, read by kvforge/tools/coverage_fixtures.py's tiny_config."""

from __future__ import annotations

from typing import Any

# Config fields the sweep shrinks, when the type's config has them. The family's other options stay.
SMALL = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
    "initializer_range": 0.2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "n_routed_experts": 8,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "sliding_window": 16, "rotary_dim": 8,
    "vocab_size_per_layer_input": 512,  # Gemma 3n's per-layer embeddings: 262,144 rows x layers (1 GB) by default
}

# (v_head_dim 8 against keys of 8 + 8: multi-head latent attention keeps keys and values of different
# sizes at test size too, as in every real MLA model; with 16 MiniCPM3 passed here but not at its own size.)

# Types whose default config does not build (dots1 leaves its expert counts unset, dbrx's nested
# attention config lacks rope_theta): what they need besides SMALL.
TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    # DBRX copies d_model into ffn_config.hidden_size while it is built, before the `hidden_size` alias is applied:
    # d_model itself, or the experts are built 2048 wide (and a saved model no longer loads). Its attention's
    # clamp fails without clip_qkv (torch.clamp needs a bound); DBRX's checkpoints set 8.
    "dbrx": {"d_model": 64, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 128}},
    "dots1": {"n_shared_experts": 1},
    # Multi-head latent attention types. AXK1 groups its experts (8 groups of 8 experts leave 1 per group, fewer
    # than the 2 its router scores per group); LongCat-Flash's layer count is 2 x num_layers (two attention
    # blocks a layer, num_hidden_layers a read-only view) and its zero (identity) experts default to 256.
    "axk1": {"n_group": 2, "topk_group": 1},
    # The same grouped routing, met once their MoE layers are kept (coverage.py's _keep_layer_kinds).
    **dict.fromkeys(("bailing_hybrid", "beam", "deepseek_v32"), {"n_group": 2, "topk_group": 1}),
    # DeepSeek-V3's first 3 layers are dense: at 2 layers it had no MoE layer (no per-layer list to keep).
    "deepseek_v3": {"first_k_dense_replace": 1, "n_group": 2, "topk_group": 1},
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2},
    # Qwen4-Exp's default config leaves its indexer unsized (its checkpoints set it); a budget of 128 positions.
    # Cohere Compass reads its rotary parameters per layer type, and its default config sets none.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Inkling 2's unpadded vocabulary (the logits kept) must fit the vocabulary.
    "inkling2_loop_text": {"unpadded_vocab_size": 512},
    # Dory: input, recurrent (looped) and output sections whose sizes must add up to the layers; its defaults (8 + 8
    # around the rest) leave a negative recurrent section at 2 layers. One layer each.
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "num_hidden_layers": 3,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # ZAYA routes each token to one expert (or to none: its router scores one more, a skip).
    "zaya": {"num_experts_per_tok": 1},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 128,
                       "indexer_compress_ratio": 4},
}


# Mamba 2 mixers at test size: heads x head size = the inner size (2 x hidden), small states and chunks.
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16}
# Where the layer kinds follow from other fields, or must be placed together: by default two layers, a
# recurrent one then an attention one (and, for Jamba, the second one's MLP a mixture of experts).
HYBRID_LAYERS: dict[str, dict[str, Any]] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "falcon_h1": {},  # every layer is both (attention and Mamba 2 side by side)
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # its default config has attention layers only
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # A Mamba layer, then two hybrid layers calling the shared attention block (each keeps its own KV). Zamba 2
    # derives hybrid_layer_ids from layers_block_type when built, before the layer_types alias is applied.
    "zamba": {"layer_types": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"layer_types": ["linear_attention", "hybrid", "hybrid"],
               "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # KV shared across layers: the last two layers reuse the first two's keys and values; E4B's activation
    # sparsity (0.95) on the first layers' MLPs.
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]},
}
# Mamba 2 mixers at test size (not at real shapes): heads x head size must be the inner size (2 x hidden = 128).
TYPE_OVERRIDES.update({
    **dict.fromkeys(("bamba", "granitemoehybrid"), MAMBA2),
    "falcon_h1": {**MAMBA2, "mamba_d_ssm": 128},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 16},
    # Zamba 2's Mamba 2 heads are 2 x hidden / n_mamba_heads = 16 wide; its shared block with rotary positions
    # and per-layer LoRA adapters, as its released checkpoints have. The adapters' width is 2 x hidden, which
    # the query's heads must fill: heads of 2 x hidden / num_attention_heads = 32 (its config's own derivation).
    "zamba2": {"head_dim": 32, "n_mamba_heads": 8, "mamba_d_state": 16, "chunk_size": 16, "use_mem_rope": True,
               "use_shared_attention_adapter": True, "adapter_rank": 8, "num_mem_blocks": 1},
    # xLSTM's config rounds its q/k width up to a multiple of 64 for its cache while the layers do not: at the
    # default factor 0.5 a 64-wide model's own cached generate fails. A factor of 1 keeps both at 64.
    "xlstm": {"qk_dim_factor": 1.0},
})
