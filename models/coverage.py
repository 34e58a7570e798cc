"""The architecture coverage sweep: every causal-LM model type of the installed transformers, built
tiny from its own default config (seeded random weights, the family's options kept), exported on
every target and checked against Hugging Face eager.

`python -m kvforge.tools.coverage_sweep --write` runs it (kvforge/tools/coverage_sweep.py: it drives the exporter
and the runtime, so it sits above them) and writes kvforge/data/coverage.json; README's
coverage table is rendered from that file (`coverage_table()`), and `kvforge export` refuses a model
type outside the passing set with the reason recorded there. Out of scope, with their reason, are
the types that are not attention decoders (OUT_OF_SCOPE).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

# kvforge.data in every layout (the repository's folders, an installed wheel, an editable install).
COVERAGE_FILE = Path(str(resources.files("kvforge") / "data" / "coverage.json"))
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
ENCODER_DECODER = "decoder of an encoder-decoder model (cross-attention); kvforge exports decoder-only models"
RECURRENT = "recurrent / state-space layers (no attention KV cache to export)"
HYBRID = "hybrid of attention and recurrent / linear-attention layers (a state cache besides the KV cache)"
NON_TEXT = "needs non-text inputs (images, audio) next to the tokens"

# Types that are not attention decoders, by why. Everything else is in scope: it passes, or it is
# refused with the missing feature (MISSING_FEATURES).
OUT_OF_SCOPE: dict[str, str] = {
    **dict.fromkeys((
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod", "xlm", "modernbert-decoder",
    ), ENCODER_ONLY),
    **dict.fromkeys((
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
        "prophetnet", "trocr", "whisper", "moshi", "speech_to_text_2",
    ), ENCODER_DECODER),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"), RECURRENT),
    **dict.fromkeys((
        "jamba", "bamba", "falcon_h1", "lfm2", "lfm2_moe", "qwen3_next", "zamba", "zamba2", "granitemoehybrid",
        "nemotron_h", "recurrent_gemma", "minimax", "kimi_linear", "olmo3_2_hybrid",
    ), HYBRID),
    **dict.fromkeys(("fuyu", "got_ocr2", "musicgen", "musicgen_melody"), NON_TEXT),
}

MULTIMODAL = ("a multimodal checkpoint (vision / audio towers around a text decoder); kvforge exports the text "
              "decoder: convert its text model type's checkpoint")
# In-scope types refused without building them (their wrappers allocate real-size towers).
NOT_SWEPT: dict[str, str] = dict.fromkeys((
    "dots3_note", "emu3", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "llama4", "mllama",
    "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
), MULTIMODAL) | {
    "blt": "byte latent transformer (a patcher and local byte encoder/decoder around the global model)",
}

# In-scope types that fail, by the feature kvforge lacks for them (the sweep's raw error is kept
# next to it in coverage.json).
ALIBI = "ALiBi position biases (no rotary or learned positions), which kvforge's attention op does not model yet"
MISSING_FEATURES: dict[str, str] = {
    **dict.fromkeys(("bloom", "mpt", "cpmant"), ALIBI),
    "diffllama": "differential attention (two softmax maps subtracted), which kvforge's one-softmax op does not model",
    "jetmoe": "mixture-of-attention-heads routing (per-token expert query/output projections): parity fails",
    "zaya": "its experts need num_experts_per_tok=1 and a routing kvforge's tiny sweep config cannot build",
    "reformer": "LSH / chunked local attention with reversible layers",
    "xlnet": "permutation language model with two-stream attention (not a causal decoder's KV cache)",
    "gemma3n_text": "a KV cache shared across layers (later layers reuse earlier layers' keys and values)",
    "gemma4_unified_assistant": "a KV cache shared across layers (a drafter reading its target model's cache)",
    "gemma4_assistant": "a KV cache shared across layers (a drafter reading its target model's cache)",
    "deepseek_v2": "rotary embedding computed in complex numbers (torch.polar / view_as_complex), which has no ONNX "
                   "form, and multi-head latent attention",
    "deepseek_v4": "compressed sparse attention (a compressed long-range KV cache besides the sliding window)",
    "llama4_text": "rotary embedding computed in complex numbers (torch.polar / view_as_complex), which has no ONNX "
                   "form",
    "dbrx": "its tiny config does not survive a save and load (nested attention / FFN configs): not swept yet",
    "qwen4_exp_text": "sparse attention (an indexer picks compressed key blocks per query)",
    "helium": "the export's logits are NaN at the first step while HF eager's are finite: not yet diagnosed",
    "dots3_note_text": "per-layer head counts (the config's attention shapes vary by layer)",
}

# Config fields the sweep shrinks, when the type's config has them. The family's other options stay.
_SMALL = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
    "initializer_range": 0.2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "n_routed_experts": 8,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "sliding_window": 16, "rotary_dim": 8,
}

# (v_head_dim 8 against keys of 8 + 8: multi-head latent attention keeps keys and values of different
# sizes at test size too, as in every real MLA model; with 16 MiniCPM3 passed here but not at its own size.)

# Types whose default config does not build (dots1 leaves its expert counts unset, dbrx's nested
# attention config lacks rope_theta): what they need besides _SMALL.
_TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
             "ffn_config": {"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 128}},
    "dots1": {"n_shared_experts": 1},
}


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# What `real=True` still shrinks: the layer count (as below) and what is not a layer's shape.
_NOT_LAYER_SHAPES = ("vocab_size", "max_position_embeddings", "num_hidden_layers")


def tiny_config(model_type: str, real: bool = False) -> Any:
    """The type's default config at test sizes: only the fields in _SMALL that it has are changed; a
    per-layer `layer_types` keeps the first layer of each kind. `real=True` keeps the default config's
    layer shapes (hidden size, heads, head size, MLP and expert sizes, expert counts: for most types
    the shapes of the model the type was written for) and shrinks only the layer count and the vocabulary."""
    from transformers import AutoConfig

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID

    default = AutoConfig.for_model(model_type)
    fields = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    # Real shapes: one layer (one of each kind where layer_types has several), to bound the memory.
    small = {**{key: _SMALL[key] for key in _NOT_LAYER_SHAPES}, "num_hidden_layers": 1} if real else _SMALL
    overrides = {key: value for key, value in small.items() if key in fields}
    if getattr(default, "sliding_window", None) is None:
        overrides.pop("sliding_window", None)  # a window only where the family has one
    # Keep the family's kind of attention: multi-head stays multi-head, multi-query multi-query.
    heads, kv_heads = getattr(default, "num_attention_heads", None), getattr(default, "num_key_value_heads", None)
    if "num_key_value_heads" in overrides and kv_heads in (None, heads):
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", 4)
    elif "num_key_value_heads" in overrides and kv_heads == 1:
        overrides["num_key_value_heads"] = 1
    if model_type == "gpt_neo":  # its per-layer pattern is a run-length list that must cover the layers
        overrides["attention_types"] = [[["global", "local"], 1]]
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        overrides["layer_types"] = kinds if len(kinds) > 1 or real else kinds * 2
        overrides["num_hidden_layers"] = len(overrides["layer_types"])
    if not real:
        overrides.update(_TYPE_OVERRIDES.get(model_type, {}))
    overrides.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **overrides)


def build_tiny(model_type: str, folder: Path, seed: int = 0, real: bool = False) -> Any:
    """Write the tiny seeded model as a Hugging Face folder (with kvforge's built-in tokenizer);
    `real=True`: at the default config's layer shapes (tiny_config)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    config = tiny_config(model_type, real)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make every layer matter for the logits (see recipes.Recipe.residual_scale)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight", "dense_4h_to_h.weight")):
                param.mul_(2.0)
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
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    experts = next((getattr(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(config, key, None), int)), None)
    ffn = getattr(config, "moe_intermediate_size", None) if experts else None
    ffn = ffn or getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
    mlp = f"{experts} experts of {ffn}" if experts else f"MLP {ffn or 4 * config.hidden_size}"
    return f"{config.hidden_size}, {heads}/{kv} heads of {head_dim}, {mlp}"


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
    summary: dict[str, Any] = {"status": status, "targets": kinds,
                               "shape": real_shape(tiny_config(model_type, real=True))}
    passed = [result["max_abs_err"] for result in targets.values() if result["status"] == "pass"]
    if passed:
        summary["max_abs_err"] = max(passed)
    if status == "fail":
        summary["error"] = errors[0][:200]
    return summary


def load_coverage() -> dict[str, Any]:
    return json.loads(COVERAGE_FILE.read_text()) if COVERAGE_FILE.is_file() else {"types": {}}


def coverage_table(coverage: dict[str, Any] | None = None) -> str:
    """README's coverage table, from coverage.json."""
    coverage = coverage or load_coverage()
    rows = coverage["types"]
    passing = sorted(t for t, r in rows.items() if r["status"] == "pass")
    refused = sorted(t for t, r in rows.items() if r["status"] == "refused")
    scope = sorted(t for t, r in rows.items() if r["status"] == "out of scope")
    lines = [f"{len(passing)} model types pass, {len(refused)} are refused, {len(scope)} are out of scope "
             f"(transformers {coverage.get('transformers', '?')}, {len(rows)} causal-LM types).", "",
             "| model_type | " + " | ".join(f"`{t}`" for t in SWEEP_TARGETS)
             + " | max logit error | real layer shape (hidden, heads, MLP) |",
             "|---|" + "---|" * len(SWEEP_TARGETS) + "---|---|"]
    def cell(result: dict[str, Any] | None) -> str:
        return {"pass": "✓", "fail": "✗"}.get(result["status"], "–") if result else "–"

    def real(summary: dict[str, Any] | None) -> str:
        if not summary:
            return "not run"
        if summary["status"] == "pass":
            return f"✓ {summary['shape']}"
        if summary["status"] == "unbuilt":
            return f"– transformers cannot build the default config: {summary['shape']}"
        marks = {"pass": "✓", "fail": "✗", "memory": "out of memory here"}
        per_target = ", ".join(f"{marks[kind]} `{target}`" if target != "all" else marks[kind]
                               for target, kind in summary["targets"].items())
        return f"{per_target}: {summary['shape']}"

    for name in passing:
        targets = rows[name]["targets"]
        error = max(targets[t]["max_abs_err"] for t in targets if targets[t]["status"] == "pass")
        lines.append(f"| `{name}` | " + " | ".join(cell(targets.get(t)) for t in SWEEP_TARGETS)
                     + f" | {error:.1e} | {real(rows[name].get('real'))} |")
    if any(rows[name]["targets"].get("trt", {}).get("status") == "untested" for name in passing):
        lines += ["", "–: not tested on `trt` at the sweep's size (its head size is outside the kernel's; "
                      "`--target trt` checks each model's own at export)."]
    trt_refused = [name for name in passing if rows[name].get("trt_reason")]
    if trt_refused:
        lines += ["", "| Passes, but refused on `trt` | Why |", "|---|---|"]
        lines += [f"| `{name}` | {rows[name]['trt_reason']} |" for name in trt_refused]
    lines += ["", "| Refused model_type | Why |", "|---|---|"]
    lines += [f"| `{name}` | {rows[name]['reason']} |" for name in refused]
    lines += ["", "| Out of scope | Why |", "|---|---|"]
    by_reason: dict[str, list[str]] = {}
    for name in scope:
        by_reason.setdefault(rows[name]["reason"], []).append(f"`{name}`")
    lines += [f"| {', '.join(names)} | {reason} |" for reason, names in by_reason.items()]
    return "\n".join(lines)
