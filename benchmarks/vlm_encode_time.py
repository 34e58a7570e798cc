"""Image encode time of an export's vision.onnx against Hugging Face eager on the same image, alternating, medians of 5.

    python benchmarks/vlm_encode_time.py make gemma-3-4b /tmp/g4/hf       # 8.6 GB fp16, ~10 GB RSS, ~4 min
    kvforge export /tmp/g4/hf -o /tmp/g4/ort --dtype fp16
    python benchmarks/vlm_encode_time.py time /tmp/g4/ort /tmp/g4/hf --size 800x600

    python benchmarks/vlm_encode_time.py make smolvlm-256m /tmp/smol/hf  # 0.91 GB fp32
    kvforge export /tmp/smol/hf -o /tmp/smol/ort
    python benchmarks/vlm_encode_time.py time /tmp/smol/ort /tmp/smol/hf --size 1024x768

THE WEIGHTS ARE transformers' OWN RANDOM INITIALISATION (`_from_config`, seed 0), the model held whole: fine for
these sizes, unlike vlm_real_shape.py's 7B shapes. Gemma 3's projector starts at zeros there, so its features are
zero on both sides: the time does not depend on the values (the tiny checkpoints' tests check those).
kvforge's side is the image path alone (`Images`: numpy preprocessing + vision.onnx), not a Generator, so that the
text graphs stay unloaded; Hugging Face's is its image processor + `get_image_features` in fp32 (PyTorch's fp16
matmuls crawl on a CPU). Two threads each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GEMMA3_4B = {"text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                             "vocab_size": 262208, "sliding_window": 1024, "max_position_embeddings": 131072,
                             "query_pre_attn_scalar": 256, "rope_parameters": {
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
             "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                               "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                               "vision_use_head": False},
             "mm_tokens_per_image": 256, "image_token_id": 262144, "boi_token_id": 255999, "eoi_token_id": 256000}
SMOLVLM_256M = {"text_config": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                "vocab_size": 49280, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
                "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                  "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
                "scale_factor": 4, "tie_word_embeddings": True}
SMOL_SPECIAL = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)], "<image>"]


def make(shape: str, out: Path) -> None:
    """Write the checkpoint: config, random weights, the image processor and a small local tokenizer."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    from kvforge.models.tokenizer import build_tokenizer

    out.mkdir(parents=True, exist_ok=False)
    tok = build_tokenizer(512)
    torch.manual_seed(0)
    if shape == "gemma-3-4b":
        tok.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
        model = transformers.Gemma3ForConditionalGeneration._from_config(
            transformers.Gemma3Config(**GEMMA3_4B), dtype=torch.float16)
        model.save_pretrained(out, max_shard_size="2GB")
        transformers.Gemma3ImageProcessor(size={"height": 896, "width": 896}).save_pretrained(out)
    else:
        tok.add_special_tokens(SMOL_SPECIAL)
        config = transformers.SmolVLMConfig(**SMOLVLM_256M, image_token_id=tok.token_to_id("<image>"))
        model = transformers.SmolVLMForConditionalGeneration._from_config(config, dtype=torch.float32)
        model.save_pretrained(out)
        transformers.SmolVLMImageProcessor(size={"longest_edge": 2048},
                                           max_image_size={"longest_edge": 512}).save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({"image_seq_len": 64,
                                                               "processor_class": "SmolVLMProcessor"}))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token=None).save_pretrained(out)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters -> {out}")


def hf_encoder(hf_dir: Path, image: Any) -> Any:
    """Hugging Face's image processor and `get_image_features` on the image, fp32, eager attention."""
    import torch
    import transformers

    from kvforge.exporter.vision import load_vision_language_model

    processor = transformers.AutoImageProcessor.from_pretrained(hf_dir, backend="pil")
    model = load_vision_language_model(hf_dir, "fp32")  # the tower and projector (a one-layer text model)
    takes = ("pixel_values", "pixel_attention_mask", "image_grid_thw")

    def encode() -> Any:
        inputs = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.model.get_image_features(**{k: v for k, v in inputs.items() if k in takes},
                                                 return_dict=True).pooler_output
        out = torch.cat(list(out)) if isinstance(out, list | tuple) else out
        return out.reshape(-1, out.shape[-1]).float().numpy()
    return encode


def time_encode(export: Path, hf_dir: Path, size: tuple[int, int], rounds: int = 5) -> None:
    import numpy as np
    import torch
    from PIL import Image

    from kvforge.runtime.drivers.images import Images
    from kvforge.runtime.text.tokenizer import Tokenizer

    torch.set_num_threads(2)
    image = Image.fromarray((np.random.RandomState(0).rand(size[1], size[0], 3) * 255).astype(np.uint8))
    tokenizer = Tokenizer(export)
    images = Images(export, json.loads((export / "kvforge.json").read_text()), None,
                    encode=lambda text, special: tokenizer.encode(text, special))

    def ours() -> Any:
        images._kept.clear()  # no cache of the image's features between rounds
        return images.encode([image])[0].features
    hf = hf_encoder(hf_dir, image)
    ours(), hf()  # sessions made, first calls out of the timing
    kept, peer = [], []
    for round_ in range(rounds):
        started = time.perf_counter()
        mine = ours()
        kept.append(time.perf_counter() - started)
        started = time.perf_counter()
        theirs = hf()
        peer.append(time.perf_counter() - started)
        print(f"round {round_ + 1}: kvforge {kept[-1]:.2f} s, Hugging Face {peer[-1]:.2f} s", flush=True)
    print(f"{mine.shape[0]} tokens: kvforge median {statistics.median(kept):.2f} s, Hugging Face eager fp32 median "
          f"{statistics.median(peer):.2f} s, ratio {statistics.median(peer) / statistics.median(kept):.2f}x; "
          f"max abs diff {float(np.abs(mine.astype(np.float32) - theirs).max()):.3g} "
          f"(largest feature {float(np.abs(theirs).max()):.3g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    making = sub.add_parser("make")
    making.add_argument("shape", choices=["gemma-3-4b", "smolvlm-256m"])
    making.add_argument("out", type=Path)
    timing = sub.add_parser("time")
    timing.add_argument("export", type=Path)
    timing.add_argument("hf_dir", type=Path)
    timing.add_argument("--size", default="800x600", help="the image's WIDTHxHEIGHT")
    timing.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.shape, args.out)
    else:
        width, height = (int(v) for v in args.size.lower().split("x"))
        time_encode(args.export, args.hf_dir, (width, height), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
