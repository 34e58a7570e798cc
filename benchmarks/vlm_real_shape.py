"""A random-weight vision-language checkpoint with the exact tensor shapes and layout of a released one, written
shard by shard (never holding the model), and what exporting it costs.

    python benchmarks/vlm_real_shape.py make llava-1.5-7b /tmp/llava-7b-shape       # ~14 GB of disk, fp16
    python benchmarks/vlm_real_shape.py make qwen2.5-vl-7b /tmp/qwen25vl-7b-shape   # ~16.6 GB of disk, fp16

THE TEXT IT MAKES IS NOISE: the weights are seeded N(0, 0.02) (norms ones). The tensors are named as the released
checkpoints name them (LLaVA-1.5: `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`; Qwen2.5-VL:
`model.*`, `visual.*`, `lm_head.*`), which transformers loads. The shapes' configs are the released ones: LLaVA-1.5-7B
(CLIP ViT-L/14 at 336 pixels + Llama-2-7B), Qwen2.5-VL-7B-Instruct (its 32-block tower + the Qwen2.5-7B text shape).
Measure an export with /usr/bin/time -v (its peak RSS) under a memory cap, e.g.

    /usr/bin/time -v systemd-run --user --scope -p MemoryMax=8G kvforge export /tmp/llava-7b-shape /tmp/llava-7b.onnx
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_real_shape import DTYPES, MARKER, Planned, Progress, chunks, peak_rss_gb, write_tokenizer  # noqa: E402

from kvforge.core.output_folder import StagedFolder, check_output, require_free_space  # noqa: E402
from kvforge.models.safetensors_shards import write_checkpoint  # noqa: E402

CLIP_L_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
              "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
              "projection_dim": 768, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001,
             "tie_word_embeddings": False}
QWEN25_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                     "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                     "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": 32768,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]}}
QWEN25_VL_7B_TOWER = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "hidden_act": "silu", "in_chans": 3}
# transformers' module names -> the released checkpoints' tensor names (what their safetensors hold).
RENAMES = {
    "llava": ((r"^model\.language_model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
              (r"^model\.vision_tower\.", "vision_tower."), (r"^model\.multi_modal_projector\.",
                                                             "multi_modal_projector.")),
    "qwen2_5_vl": ((r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual.")),
}


def llava_config() -> Any:
    from transformers import LlavaConfig

    return LlavaConfig(text_config=LLAMA2_7B, vision_config=CLIP_L_336, image_token_id=32000,
                       projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                       architectures=["LlavaForConditionalGeneration"], dtype="float16")


def qwen_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=QWEN25_VL_7B_TEXT, vision_config=QWEN25_VL_7B_TOWER,
                            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                            vision_end_token_id=151653, architectures=["Qwen2_5_VLForConditionalGeneration"],
                            dtype="float16")


SHAPES = {"llava-1.5-7b": llava_config, "qwen2.5-vl-7b": qwen_config}
# The special tokens a family's processor writes around an image, at the released tokenizers' ids.
SPECIAL_TOKENS = {
    "llava": {"<image>": 32000, "<pad>": 32001},
    "qwen2_5_vl": {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                   "<|video_pad|>": 151656},
}


def add_special_tokens(folder: Path, tokens: dict[str, int]) -> None:
    """Give the local tokenizer (make_real_shape.write_tokenizer's) the family's image tokens at their released ids."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    for content, token_id in tokens.items():
        if content in spec["model"]["vocab"]:
            continue
        spec["model"]["vocab"][content] = token_id
        spec["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(spec))


def tensor_plan(config: Any, dtype: str) -> list[Planned]:
    """The checkpoint's tensors (released names) in state-dict order, from the model built on the meta device."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES[config.model_type])
    with torch.device("meta"):
        model = cls(config)
    itemsize = getattr(torch, DTYPES[dtype][0]).itemsize
    plan = []
    for name, tensor in model.state_dict().items():
        for pattern, new in RENAMES[config.model_type]:
            name = re.sub(pattern, new, name)
        plan.append(Planned(len(plan), name, tuple(tensor.shape), tensor.numel(), tensor.numel() * itemsize))
    return plan


def save_processor(config: Any, folder: Path) -> None:
    """The released image processor's settings (CLIP at 336 pixels; Qwen2-VL's with its pixel bounds)."""
    import warnings

    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config.model_type == "llava":
            transformers.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                            ).save_pretrained(folder)
        else:
            transformers.Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056).save_pretrained(folder)


def make(shape: str, out_dir: Path, dtype: str = "fp16", shard_gb: float = 5.0, seed: int = 0,
         force: bool = False) -> Path:
    from transformers import GenerationConfig

    config = SHAPES[shape]()
    out_dir = Path(out_dir).absolute()
    check_output(out_dir, [], force=force, marker=MARKER, what="real-shape checkpoint")
    plan = tensor_plan(config, dtype)
    total = sum(tensor.nbytes for tensor in plan)
    print(f"{shape}: {len(plan)} tensors, {total / 1e9:.2f} GB, {DTYPES[dtype][0]}, seed {seed} -> {out_dir}")
    require_free_space(out_dir.parent, total, f"the checkpoint of {shape}")
    text = config.text_config
    with StagedFolder(out_dir, MARKER, what="real-shape checkpoint") as staged:
        staging = staged.path
        assert staging is not None
        write_tokenizer(staging, text.vocab_size, text.bos_token_id, text.eos_token_id)
        add_special_tokens(staging, SPECIAL_TOKENS[config.model_type])
        config.save_pretrained(staging)
        save_processor(config, staging)
        GenerationConfig(bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id).save_pretrained(staging)
        write_checkpoint(staging, plan, DTYPES[dtype][1], lambda tensor: chunks(tensor, dtype, seed),
                         int(shard_gb * 1e9), Progress(len(plan), total, print))
        (staging / MARKER).write_text(json.dumps(
            {"shape": shape, "dtype": dtype, "seed": seed, "random_weights": True, "bytes": total}, indent=2) + "\n")
        staged.publish()
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["make"])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    folder = make(args.shape, args.out_dir, args.dtype, args.shard_gb, force=args.force)
    print(f"wrote {folder} in {time.monotonic() - started:.1f} s; peak RSS {peak_rss_gb():.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
