"""Small built-in model recipes: HF configs + seeded random weights + a locally built tokenizer.

Nothing is downloaded. `materialize(name, folder)` writes an ordinary Hugging Face folder
(config.json, model.safetensors, tokenizer.json, generation_config.json) that `from_pretrained`
loads like any other. THE WEIGHTS ARE RANDOM: the text they produce is noise; they exist so that
export, runtime and parity can be exercised (and compared against HF eager) without a hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk
from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer


@dataclass(frozen=True)
class Recipe:
    model_type: str
    description: str
    config: dict[str, Any]
    tokenizer_vocab: int = 512
    # Random weights make residual branches tiny next to the embeddings, so a broken attention
    # could still reproduce HF's tokens. Scaling the projections that write into the residual
    # stream makes every layer (and the KV cache) matter for the logits.
    residual_scale: float = 2.0
    # Gemma scales its embeddings by sqrt(hidden) and normalises every block's output, so random
    # weights let the embedding drown the layers (greedy text collapses into one repeated token).
    # Smaller embeddings and random norm gains (which also exercise Gemma's 1 + w) make layers count.
    embedding_scale: float = 1.0
    norm_std: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # A vision-language recipe: its image processor (the transformers class and its settings, saved as
    # preprocessor_config.json) and the chat template its tokenizer carries; built as the whole model.
    image_processor: tuple[str, dict[str, Any]] | None = None
    chat_template: str | None = None
    # A pre-quantised recipe: written as a checkpoint the named library quantised (models/recipe_checkpoints.py).
    prequantised: str | None = None


_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    # Larger than HF's 0.02 so greedy decoding does not collapse into one repeated token.
    initializer_range=0.2,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)

# LLaVA-1.5's chat template as llava-hf ships it: a message's image parts first ("<image>\n" each), then its text
# parts. A str content (a text-only message) is one text part. (Without the `{% generation %}` tag transformers
# adds for training masks: it renders nothing.)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
_IMAGE_SIDE = 56  # the tiny tower's images: 4 x 4 patches of 14 pixels, 16 image tokens
_IMAGE_TOKEN_ID = 520  # beyond the tokenizer's 512 ids: an image's place is never typed as text

RECIPES: dict[str, Recipe] = {
    "llama-tiny": Recipe("llama", "Llama, GQA 4/2 heads, untied embeddings", {**_TINY, "tie_word_embeddings": False}),
    "llama-tiny-autoround": Recipe(
        "llama", "llama-tiny as an AutoRound int4 checkpoint, made by auto-round on the CPU (about 10 s): a "
        "pre-quantised import to try", {**_TINY, "tie_word_embeddings": False}, prequantised="auto-round",
    ),
    "llama3-tiny": Recipe(
        "llama", "Llama 3.x: llama3 rope scaling, tied embeddings",
        {**_TINY, "tie_word_embeddings": True, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral-tiny": Recipe(
        "mistral", "Mistral with a 16-token sliding window (so the window is exercised)",
        {**_TINY, "sliding_window": 16, "tie_word_embeddings": False},
    ),
    "qwen2-tiny": Recipe("qwen2", "Qwen2: q/k/v bias, tied embeddings", {**_TINY, "tie_word_embeddings": True}),
    "qwen3-tiny": Recipe(
        "qwen3", "Qwen3: q/k norm, head_dim 32 != hidden/heads 16",
        {**_TINY, "head_dim": 32, "tie_word_embeddings": False},
    ),
    "phi3-tiny": Recipe(
        "phi3", "Phi-3: fused qkv and gate/up, LongRoPE (short factors: calls stay under its original length)",
        {**_TINY, "tie_word_embeddings": False, "max_position_embeddings": 4096, "original_max_position_embeddings": 2048,
         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                          "long_factor": [2.0 + 0.5 * i for i in range(8)]}},
    ),
    "phi4-mini-tiny": Recipe(
        "phi3", "Phi-4-mini: partial rotary (0.75), LongRoPE with long factors (every call is past original_max 4)",
        {**_TINY, "tie_word_embeddings": True, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4,
         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                          "long_factor": [2.0 + 0.5 * i for i in range(6)]}},
    ),
    "gemma-tiny": Recipe(
        "gemma", "Gemma: embedding scaling, RMSNorm +1, GeGLU, head_dim 256, MQA",
        {**_TINY, "head_dim": 256, "num_key_value_heads": 1, "hidden_activation": "gelu_pytorch_tanh",
         "tie_word_embeddings": True},
    ),
    "gemma2-tiny": Recipe(
        "gemma2", "Gemma 2: attention and final-logit softcaps, query_pre_attn_scalar, sliding (16) / global layers",
        {**_TINY, "head_dim": 32, "num_hidden_layers": 4, "sliding_window": 16, "query_pre_attn_scalar": 24,
         "attn_logit_softcapping": 5.0, "final_logit_softcapping": 1.0, "tie_word_embeddings": True},
        embedding_scale=0.1, norm_std=1.0,
    ),
    "gemma3-tiny": Recipe(
        "gemma3_text", "Gemma 3 (text): q/k norm, sliding (16) / global layers with their own RoPE bases",
        {**_TINY, "head_dim": 32, "num_hidden_layers": 3, "sliding_window": 16, "query_pre_attn_scalar": 24,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 1.0,
         "tie_word_embeddings": True},
        embedding_scale=0.1, norm_std=1.0,
    ),
    "gpt2-tiny": Recipe(
        "gpt2", "GPT-2: learned positions, multi-head attention, biases, LayerNorm, Conv1D",
        dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=2048,
             initializer_range=0.2, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID),
    ),
    "olmo2-tiny": Recipe("olmo2", "OLMo 2: post-norm blocks, q/k RMSNorm", {**_TINY, "tie_word_embeddings": False}),
    "granite-tiny": Recipe(
        "granite", "Granite: embedding, residual, attention and logit multipliers",
        {**_TINY, "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
         "logits_scaling": 4.0, "tie_word_embeddings": True},
    ),
    "smollm3-tiny": Recipe(
        "smollm3", "SmolLM3: a layer without RoPE (NoPE) after a rotary one",
        {**_TINY, "no_rope_layers": [1, 0], "tie_word_embeddings": True},
    ),
    "llava-tiny": Recipe(
        "llava", "LLaVA-1.5's layout: a 2-layer CLIP tower (16 tokens an image), a projector and a Llama; "
        "LLaVA-1.5's chat template",
        dict(text_config={**_TINY, "model_type": "llama", "vocab_size": _IMAGE_TOKEN_ID + 8, "tie_word_embeddings": False},
             vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=_IMAGE_SIDE, patch_size=14, projection_dim=64),
             image_token_id=_IMAGE_TOKEN_ID, image_seq_length=16, vision_feature_layer=-2,
             vision_feature_select_strategy="default", tie_word_embeddings=False),
        image_processor=("CLIPImageProcessor", {"size": {"shortest_edge": _IMAGE_SIDE},
                                                "crop_size": {"height": _IMAGE_SIDE, "width": _IMAGE_SIDE}}),
        chat_template=LLAVA_CHAT_TEMPLATE,
    ),
    "demo-llama": Recipe(
        "llama", "the demo: a ~3M-parameter Llama (random weights)",
        dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=True,
             initializer_range=0.1),
        tokenizer_vocab=512, residual_scale=2.0,
    ),
    "smollm2-135m-shape": Recipe(
        "llama", "SmolLM2-135M's shape (30 layers, 576 hidden, 9/3 heads, 49152 vocab), random weights",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID),
        # The built-in corpus trains ~545 BPE tokens, so ids above 512 decode to nothing: the
        # benchmark feeds token ids and reads speeds, not text.
        tokenizer_vocab=512, residual_scale=1.0,
    ),
    "qwen2-0.5b-shape": Recipe(
        "qwen2", "Qwen2-0.5B's shape (24 layers, 896 hidden, 14/2 heads, q/k/v bias, 151936 vocab), random weights",
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID),
        tokenizer_vocab=512, residual_scale=1.0,
    ),
}

# The tiny recipes every family's parity tests run (tests/families/test_families.py: at least one per family). The
# vision-language recipe is checked by tests/cli/test_vision_first_hour.py (its family by tests/families/test_vision_language.py).
FAMILY_RECIPES = [name for name, recipe in RECIPES.items() if name.endswith("-tiny") and recipe.image_processor is None]

# A picture to ask a vision-language recipe about (a house under the sun, 128 x 96, shipped in the package).
SAMPLE_IMAGE = Path(str(files("kvforge") / "data" / "sample.png"))

RECIPE_MARKER = "kvforge_recipe.json"

def build_model(name: str, seed: int = 0, dtype: str = "float32"):
    """The recipe's HF model with seeded random weights (needs the `export` extra)."""
    import torch
    import transformers

    recipe = get_recipe(name)
    config = transformers.AutoConfig.for_model(recipe.model_type, **recipe.config)
    torch.manual_seed(seed)
    # A vision-language recipe is the whole model (LlavaForConditionalGeneration ...), as its checkpoints are saved.
    auto = transformers.AutoModelForCausalLM if recipe.image_processor is None else transformers.AutoModelForImageTextToText
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if module_name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):  # c_proj: GPT-2
                param.mul_(recipe.residual_scale)
            elif module_name.endswith("embed_tokens.weight"):
                param.mul_(recipe.embedding_scale)
            elif recipe.norm_std is not None and "norm" in module_name and module_name.endswith(".weight"):
                param.normal_(0.0, recipe.norm_std)
    return model.eval()


def materialize(name: str, folder: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Write the recipe as a Hugging Face folder. Written to a temporary sibling, renamed into place."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    recipe = get_recipe(name)
    folder = Path(folder).absolute()
    # Only a folder this function wrote (it has the recipe marker) is ever replaced.
    check_output(folder, [], force=force, marker=RECIPE_MARKER, what="kvforge recipe folder")
    # safetensors reports a full disk without a path (SafetensorError): said as a full disk at `folder`.
    with naming_a_full_disk(folder), StagedFolder(folder, RECIPE_MARKER, what="kvforge recipe folder") as staged:
        staging = staged.path
        assert staging is not None
        model = build_model(name, seed=seed)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=build_tokenizer(recipe.tokenizer_vocab),
            bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token=None,
        )
        if recipe.chat_template is not None:
            tokenizer.chat_template = recipe.chat_template
        tokenizer.save_pretrained(staging)
        if recipe.image_processor is not None:
            _save_image_processor(recipe.image_processor, staging)
        if recipe.prequantised is not None:
            from kvforge.models.recipe_checkpoints import prequantise

            prequantise(recipe.prequantised, model, tokenizer, staging)
        GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
        ).save_pretrained(staging)
        (staging / RECIPE_MARKER).write_text(
            json.dumps({"recipe": name, "seed": seed, "random_weights": True, "description": recipe.description}, indent=2)
        )
        staged.publish()
    return folder


def _save_image_processor(processor: tuple[str, dict[str, Any]], folder: Path) -> None:
    """The recipe's image processor as preprocessor_config.json in `folder` (the Pillow form: no torchvision)."""
    import transformers
    from transformers.utils import logging as hf_logging

    name, settings = processor
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "requires torchvision ... falling back to the Pillow backend": as meant
    try:
        getattr(transformers, name)(**settings).save_pretrained(folder)
    finally:
        hf_logging.set_verbosity(level)


def recipe_folder(name: str, folder: str | Path, say: Callable[[str], None] | None = None) -> bool:
    """The recipe's Hugging Face folder at `folder`: reused when it already holds this recipe (its marker
    says so), else built (replacing only a folder this module wrote). True when it was built now."""
    say = say or (lambda _msg: None)
    recipe = get_recipe(name)
    folder = Path(folder)
    marker = folder / RECIPE_MARKER
    try:
        written = json.loads(marker.read_text()) if marker.is_file() else {}
        same = written.get("recipe") == name and written.get("seed", 0) == 0
    except (OSError, ValueError, AttributeError):
        same = False  # an unreadable marker: built again (materialize refuses a folder it did not write)
    if same:
        say(f"reusing the built-in recipe {name!r} in {folder}")
        return False
    say(f"building the built-in recipe {name!r} (random weights) in {folder}: {recipe.description}")
    materialize(name, folder, force=True)
    return True


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`, or a one-line error naming the built-in ones."""
    if name not in RECIPES:
        raise InputError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)} (`kvforge recipes` describes them)")
    return RECIPES[name]
