"""The architecture coverage sweep's fixtures: every causal-LM model type of the installed transformers, built
tiny from its own default config (seeded random weights, the family's options kept), and what the sweep records
beside its outcomes (the reasons of types refused or out of scope).

`python -m kvforge.tools.coverage_sweep --write` runs the sweep (kvforge/tools/coverage_sweep.py) and writes
kvforge/data/coverage.json; README's coverage table is rendered from that file (kvforge/tools/coverage_table.py),
and `kvforge export` refuses a model type outside the passing set with the reason recorded there (the registry
reads the file alone: kvforge/models/coverage_data.py). Out of scope, with their reason, are the types that are
not attention decoders (OUT_OF_SCOPE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.models.config_values import config_value  # layer 0's where the config sets it per layer
from kvforge.models.coverage_data import COVERAGE_FILE, load_coverage  # noqa: F401 - the sweep's file, re-exported
from kvforge.models.families.deepseek_sparse import REFUSAL as SPARSE_ATTENTION_REFUSAL
from kvforge.tools.sweep_configs import HYBRID_LAYERS, SMALL, TYPE_OVERRIDES

SWEEP_TARGETS = ("ort", "onnx", "trt")
# A type passes when it passes on these; `trt` (kvforge's own kernel, checked here through its CPU
# emulation) is a column of its own: a type that passes but fails there is refused on `--target trt`.
REQUIRED_TARGETS = ("ort", "onnx")
KERNEL_SHAPES = "kvforge's attention kernel supports"  # in the `trt` target's refusal of a head layout
ATOL = 1e-3  # fp32, parity's own default
NEW_TOKENS = 32
# Prompts of different lengths, as a batch and each alone: the batch must give each prompt's tokens.
PROMPTS = ("Once upon a time", "The quick brown fox jumps over the lazy dog. Attention lets every token look back",
           "def main(): return 42")

ENCODER_ONLY = "encoder-only (bidirectional) model with a decoder head; kvforge exports causal decoders"
ENCODER_DECODER = "decoder of an encoder-decoder model (cross-attention) kvforge does not export"
# Encoder-decoders kvforge exports whole (models/encoder_decoders.py); their decoder alone (...ForCausalLM) is not a
# decoder-only model.
EXPORTED_WHOLE = "the decoder alone of an encoder-decoder kvforge exports whole: docs/encoder-decoder.md"
NON_TEXT = "needs non-text inputs (images, audio) next to the tokens"

# Types that are not attention decoders, by why. Everything else is in scope: it passes, or it is
# refused with the missing feature (MISSING_FEATURES).
OUT_OF_SCOPE: dict[str, str] = {
    **dict.fromkeys((
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod", "xlm", "modernbert-decoder",
    ), ENCODER_ONLY),
    **dict.fromkeys(("bigbird_pegasus", "mvp", "prophetnet", "trocr", "moshi", "speech_to_text_2"), ENCODER_DECODER),
    **dict.fromkeys(("bart", "blenderbot", "blenderbot-small", "marian", "mbart", "pegasus", "plbart", "whisper"),
                    EXPORTED_WHOLE),
    **dict.fromkeys(("fuyu", "got_ocr2", "musicgen", "musicgen_melody"), NON_TEXT),
}

# In-scope types refused without building them.
NOT_SWEPT: dict[str, str] = {
    "blt": "byte latent transformer (a patcher and local byte encoder/decoder around the global model)",
}

# In-scope types that fail, by the feature kvforge lacks for them (the sweep's raw error is kept
# next to it in coverage.json).
# CPM-Ant's positions are a learned bias per head and bucketed query-key distance (and segment pair), as T5's.
RELATIVE_BIAS = ("a learned relative position bias (per head, bucketed query-key distance and segment pair, as T5's), "
                 "which kvforge's attention op does not model")
# Exact as dense attention only while a row's context fits in index_topk (2048 in DeepSeek-V3.2).
DSA = SPARSE_ATTENTION_REFUSAL
MISSING_FEATURES: dict[str, str] = {
    "cpmant": RELATIVE_BIAS,
    "diffllama": "differential attention (two softmax maps subtracted), which kvforge's one-softmax op does not model",
    # Diagnosed: every step agrees but one, where the tiny model's greedy token is its pad token, whose embedding HF
    # initialises to zeros; layer 0's attention-expert router then scores all experts 0 and torch.topk (experts 6, 5)
    # and ONNX TopK (0, 1) break the tie differently. Not a kvforge error, but the sweep cannot pass it as built.
    "jetmoe": "parity fails at one step of the tiny model, where its pad token's zero embedding makes the attention-"
              "expert router's scores tie exactly and torch and ONNX TopK break the tie differently",
    "reformer": "LSH / chunked local attention with reversible layers",
    "xlnet": "permutation language model with two-stream attention (not a causal decoder's KV cache)",
    "gemma4_unified_assistant": "a KV cache shared across layers (a drafter reading its target model's cache)",
    "gemma4_assistant": "a KV cache shared across layers (a drafter reading its target model's cache)",
    "deepseek_v4": "compressed sparse attention (a compressed long-range KV cache besides the sliding window)",
    # Diagnosed: parity fails by 2e-3 on every target. kvforge keys a layer's KV cache by its attention module, so
    # the looped layers' calls share one cache: earlier loops read the keys the last one wrote, which is Dory's
    # "last_loop" mode (HF's per_loop and last_loop logits differ by exactly the export's error, 0.00201, step 5).
    "dory": "recurrent-depth loops whose every pass keeps its own copy of the looped layers' KV cache "
            "(recurrent_kv_cache_mode per_loop, the default), while kvforge keeps one cache per attention module "
            "(Dory's last_loop mode): parity fails",
    "inkling2_loop_text": "a hidden-state-conditioned relative position bias added to the attention scores, and layers "
                          "run in loops (loop_num_passes) with messages between passes, which kvforge's attention op "
                          "and per-layer KV cache do not model",
    "hrm_text": "a hierarchical reasoning model: it runs its layers in loops (the same attention modules several times "
                "per token), which a per-layer KV cache does not describe",
}

# A multimodal type (MULTIMODAL_TYPES) whose tiny checkpoint is not built here.
NOT_SWEPT["gemma3n"] = ("a multimodal checkpoint whose tiny form is not built here (its vision tower needs timm, which "
                        "kvforge does not install): not swept, though its text model, gemma3n_text, passes")

def causal_lm_types() -> list[str]:
    """Every model type the sweep covers, sorted: each transformers maps to a causal-LM class, and the multimodal
    types whose text model it ships without one (Qwen-VL's: kvforge makes it, models/families/qwen_vl.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MULTIMODAL_TYPES))


# What `real=True` still shrinks: the layer count (as below) and what is not a layer's shape.
_NOT_LAYER_SHAPES = ("vocab_size", "max_position_embeddings", "num_hidden_layers")


def _keep_layer_kinds(default: Any, overrides: dict[str, Any]) -> None:
    """Each kind of a per-layer list other than layer_types (MLP kinds dense/sparse, NoPE layers, indexer kinds)
    kept at the cut layer count: cut to its first layers, a model lost its MoE or NoPE layers (issue 43)."""
    layers = getattr(default, "num_hidden_layers", None)
    for field, values in vars(default).items():
        if field == "layer_types" or not isinstance(values, list) or len(values) != layers or not layers:
            continue
        kinds = list(dict.fromkeys(values))
        # Kinds, not layer indices or per-layer sizes: a few strings, or 0/1 flags.
        if not 2 <= len(kinds) <= 4 or not all(isinstance(k, str) or k in (0, 1) for k in kinds):
            continue
        count = max(len(kinds), overrides.get("num_hidden_layers", SMALL["num_hidden_layers"]))
        overrides[field] = [kinds[i % len(kinds)] for i in range(count)]
        if "layer_types" in overrides and len(overrides["layer_types"]) != count:
            overrides["layer_types"] = [overrides["layer_types"][i % len(overrides["layer_types"])]
                                        for i in range(count)]
        overrides["num_hidden_layers"] = count


def tiny_config(model_type: str, real: bool = False) -> Any:
    """The type's default config at test sizes: only the fields in SMALL that it has are changed; a
    per-layer `layer_types` keeps the first layer of each kind. `real=True` keeps the default config's
    layer shapes (hidden size, heads, head size, MLP and expert sizes, expert counts: for most types
    the shapes of the model the type was written for) and shrinks only the layer count and the vocabulary."""
    from transformers import AutoConfig

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID

    default = AutoConfig.for_model(model_type)
    fields = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    # Real shapes: one layer (one of each kind where layer_types has several), to bound the memory.
    small = {**{key: SMALL[key] for key in _NOT_LAYER_SHAPES}, "num_hidden_layers": 1} if real else SMALL
    overrides = {key: value for key, value in small.items() if key in fields}
    if getattr(default, "sliding_window", None) is None:
        overrides.pop("sliding_window", None)  # a window only where the family has one
    # Keep the family's kind of attention: multi-head stays multi-head, multi-query multi-query.
    heads, kv_heads = config_value(default, "num_attention_heads"), config_value(default, "num_key_value_heads")
    if "num_key_value_heads" in overrides and kv_heads in (None, heads):
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", 4)
    elif "num_key_value_heads" in overrides and kv_heads == 1:
        overrides["num_key_value_heads"] = 1
    if model_type == "gpt_neo":  # its per-layer pattern is a run-length list that must cover the layers
        overrides["attention_types"] = [[["global", "local"], 1]]
    layer_types = getattr(default, "layer_types", None)
    # Where layer_types is derived from other fields (a property without a setter: Mamba, Jamba, Bamba),
    # HYBRID_LAYERS places one layer of each kind instead.
    field = getattr(default, "attribute_map", {}).get("layer_types", "layer_types")
    settable = getattr(getattr(type(default), field, None), "fset", True) is not None
    if isinstance(layer_types, list) and layer_types and settable:
        kinds = list(dict.fromkeys(layer_types))
        overrides["layer_types"] = kinds if len(kinds) > 1 or real else kinds * 2
        overrides["num_hidden_layers"] = len(overrides["layer_types"])
    if not real and model_type not in HYBRID_LAYERS:  # those place their kinds by hand
        _keep_layer_kinds(default, overrides)
    if model_type in HYBRID_LAYERS:
        placed = HYBRID_LAYERS[model_type]
        overrides.update(placed, num_hidden_layers=len(placed.get("layer_types", "rr")))
    if not real:
        overrides.update(TYPE_OVERRIDES.get(model_type, {}))
    overrides.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    config = AutoConfig.for_model(model_type, **overrides)
    rope = overrides.get("qk_rope_head_dim") if "qk_nope_head_dim" in overrides else None
    if rope is not None and "head_dim" in overrides and (config_value(config, "head_dim"),
                                                              config_value(config, "qk_rope_head_dim")) != (rope, rope):
        # Multi-head latent attention: `head_dim` is the rotary slice's size, which the rotary embedding reads
        # (the key's head size is qk_nope_head_dim + qk_rope_head_dim). Where the head_dim passed in is kept as it
        # is (DeepSeek-V3, LongCat) or is an alias that overrides qk_rope_head_dim (GLM-4-MoE-Lite), pass the
        # rotary size; configs that derive it themselves keep their own build.
        config = AutoConfig.for_model(model_type, **{**overrides, "head_dim": rope})
    return config


# Multimodal checkpoints (a text decoder inside vision / audio towers, saved as the type's
# ...ForConditionalGeneration): the sweep builds the whole checkpoint, its towers shrunk to these sizes and its
# text config by tiny_config's rules, and kvforge exports its text model (kvforge/exporter/text_model.py).
MULTIMODAL_TYPES = (
    "dots3_note", "emu3", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "llama4", "mllama",
    "moss_transcribe_diarize", "phi4_multimodal", "qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl",
    "qwen4_exp",
)
_TOWER_SMALL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "attention_heads": 2, "num_heads": 2, "depth": 1, "num_global_layers": 1,
    "num_blocks": 1, "conf_num_hidden_layers": 1, "conf_num_attention_heads": 2,
}
# What a type's sub-configs need besides _TOWER_SMALL (sizes tied to other fields), and its text config
# besides tiny_config's rules ("": the top level).
_MULTIMODAL_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    # Emu3's image tokens map to text-vocabulary ids (its VQ-VAE's codes are BPE tokens too).
    "emu3": {"": {"vocabulary_map": {"<|extra_200|>": 500, "<image>": 501,
                                     **{f"<|visual token {code:06d}|>": 502 + code for code in range(8)}},
                  "image_token_id": 501},
             "vq_config": {"codebook_size": 8, "base_channels": 32, "channel_multiplier": [1, 1],
                           "num_res_blocks": 1, "attn_resolutions": []}},
    # dots3's vision tower sets its experts per layer for its 42 layers (a "pyramid" from layer 25): one dense layer.
    # Its adapters' widths must match the towers' and the text model's hidden sizes.
    "dots3_note": {"vision_config": {"mlp_layer_types": ["dense"], "per_layer_config": {}, "adapter_in_dim": 32,
                                     "adapter_out_dim": 64},
                   "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 64, "downsample_hidden_size": 32}},
    # A cross-attention layer (to the image) between two self-attention layers: a tokens-only forward skips it.
    "mllama": {"text_config": {"num_hidden_layers": 3, "cross_attention_layers": [1]}},
}


def _tie_qwen_vl(model_type: str, fields: dict[str, dict[str, Any]]) -> None:
    """Qwen-VL's sizes tied across its sub-configs: the tower's merger outputs the text model's hidden size, and the
    M-RoPE sections (temporal, height, width) split half the text head size, as the default's split 128."""
    if model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        return
    text, vision = fields["text_config"], fields["vision_config"]
    out = "hidden_size" if model_type == "qwen2_vl" else "out_hidden_size"
    vision.update({out: text["hidden_size"]}, **({"embed_dim": 32} if model_type == "qwen2_vl" else {}))
    half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    rope = dict(text.get("rope_parameters") or {})
    default = rope.get("mrope_section") or [16, 24, 24]
    section = [half * part // sum(default) for part in default]
    section[0] += half - sum(section)
    text["rope_parameters"] = {**rope, "mrope_section": section}


def tiny_multimodal_config(model_type: str, real: bool = False) -> Any:
    """A multimodal type's default config at test sizes: its text config as tiny_config(text type, real)
    makes it (or, for a type that is its own text config, Phi-4-multimodal, the top level), its vision /
    audio sub-configs shrunk (_TOWER_SMALL: the towers build in seconds; `real` keeps them small too)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    overrides = _MULTIMODAL_OVERRIDES.get(model_type, {})
    fields: dict[str, Any] = {}
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is None:
            continue
        if name == "text_config":
            values = tiny_config(sub.model_type, real).to_dict()
        else:
            values = sub.to_dict()
            values.update({key: min(value, values[key]) for key, value in _TOWER_SMALL.items()
                           if isinstance(values.get(key), int) and not isinstance(values.get(key), bool)})
        fields[name] = {**values, **overrides.get(name, {})}
    _tie_qwen_vl(model_type, fields)
    top = {} if "text_config" in fields else tiny_config(model_type, real).to_dict()
    top.pop("model_type", None)
    return AutoConfig.for_model(model_type, **{**top, **fields, **overrides.get("", {})})


def build_tiny(model_type: str, folder: Path, seed: int = 0, real: bool = False) -> Any:
    """Write the tiny seeded model as a Hugging Face folder (with kvforge's built-in tokenizer);
    `real=True`: at the default config's layer shapes (tiny_config). A multimodal type (MULTIMODAL_TYPES) is
    written as its whole checkpoint, small towers included (tiny_multimodal_config)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    multimodal = model_type in MULTIMODAL_TYPES
    config = tiny_multimodal_config(model_type, real) if multimodal else tiny_config(model_type, real)
    torch.manual_seed(seed)
    if multimodal:  # the class its checkpoints are saved from (Gemma3ForConditionalGeneration, ...)
        model = getattr(transformers, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[model_type])._from_config(
            config, dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make every layer matter for the logits (see recipes.Recipe.residual_scale)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight", "dense_4h_to_h.weight")):
                param.mul_(2.0)
            # A router HF initialises to zeros (AFMoE) scores every expert alike: its top-k is then a tie that
            # each runtime breaks its own way. Trained routers are not zero; give it random weights.
            if ".router." in name and name.endswith("weight") and not param.any():
                param.normal_(0.0, config_value(config, "initializer_range") or 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(512), bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token=None).save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     do_sample=False).save_pretrained(folder)
    return model


MEMORY_ERRORS = ("MemoryError", "bad_alloc", "out of memory", "Cannot allocate memory", "Failed to allocate memory")


def real_shape(config: Any) -> str:
    """A real-shape config's layer shape, for the table: hidden size, heads / KV heads x head size, MLP
    or experts."""
    heads = config_value(config, "num_attention_heads")
    kv = config_value(config, "num_key_value_heads") or heads
    head_dim = config_value(config, "head_dim") or (config.hidden_size // heads if heads else None)
    if config_value(config, "qk_head_dim") and config_value(config, "v_head_dim"):  # latent attention
        head_dim = f"{config_value(config, 'qk_head_dim')} (values {config_value(config, 'v_head_dim')})"
    experts = next((config_value(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(config_value(config, key), int)), None)
    ffn = config_value(config, "moe_intermediate_size") if experts else None
    ffn = ffn or config_value(config, "intermediate_size") or config_value(config, "ffn_dim")
    mlp = f"{experts} experts of {ffn}" if experts else f"MLP {ffn or 4 * config.hidden_size}"
    attention = f"{heads}/{kv} heads of {head_dim}" if heads else "no attention heads"
    per_layer = " (layer 0's; set per layer)" if config.to_dict().get("per_layer_config") else ""
    return f"{config.hidden_size}, {attention}{per_layer}, {mlp}"


def real_summary(model_type: str, row: dict[str, Any]) -> dict[str, Any]:
    """A `--real` sweep row as the registry row's `real` entry: pass where every swept target passed;
    "memory" where this machine ran out of memory (not a kvforge failure); else fail, with the error."""
    targets = row.get("targets", {})

    def kind(result: dict[str, Any]) -> str:
        if result["status"] == "pass":
            return "pass"
        if any(m in result.get("error", "") for m in MEMORY_ERRORS):
            return "memory"
        return "unbuilt" if result.get("error", "").startswith("building:") else "fail"

    kinds = {target: kind(result) for target, result in targets.items()}
    if row.get("error"):  # the type's process died before reporting its targets
        kinds["all"] = kind({"status": "fail", "error": row["error"]})
    errors = [result.get("error", "") for result in targets.values() if kind(result) == "fail"]
    errors += [row["error"]] if kinds.get("all") == "fail" else []
    status = "fail" if errors else ("pass" if kinds and set(kinds.values()) == {"pass"}
                                    else "unbuilt" if "unbuilt" in kinds.values() else "memory")
    if model_type in MULTIMODAL_TYPES:  # the shape of its text model (a type that is its own text config: itself)
        config = tiny_multimodal_config(model_type, real=True)
        config = getattr(config, "text_config", None) or config
    else:
        config = tiny_config(model_type, real=True)
    summary: dict[str, Any] = {"status": status, "targets": kinds, "shape": real_shape(config)}
    passed = [result["max_abs_err"] for result in targets.values() if result["status"] == "pass"]
    if passed:
        summary["max_abs_err"] = max(passed)
    if status == "fail":
        summary["error"] = errors[0][:200]
    return summary
