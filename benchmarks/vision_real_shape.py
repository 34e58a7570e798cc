"""A vision-language checkpoint at real shapes, without a hub, and what its export costs.

    python benchmarks/vision_real_shape.py make TEXT_DIR OUT_DIR     # LLaVA-1.5's tower around a text checkpoint
    python benchmarks/vision_real_shape.py measure HF_DIR EXPORT_DIR [--rounds 5] [--json FILE]

`make` writes a LLaVA checkpoint whose text model is TEXT_DIR's (a Llama-shaped random checkpoint, e.g. the
Llama-3.2-1B shape), its tensors copied one by one under LLaVA's names, with LLaVA-1.5's image tower (CLIP
ViT-L/14 at 336 pixels: 24 layers, 1024 wide, 576 image tokens) and projector as seeded random tensors in the
text checkpoint's dtype,
written shard by shard: making it never holds the model. `measure` times, in one process, alternating: the
image's features through vision.onnx (ONNX Runtime CPU) against Hugging Face's get_image_features (torch eager),
and the first token of a prompt with the image against the same prompt without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

TOWER = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
         "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu",
         "model_type": "clip_vision_model"}


def make(text_dir: Path, out: Path) -> None:
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    text = json.loads((text_dir / "config.json").read_text())
    image_token = text["vocab_size"] - 1  # a real token id the text model has; the prompt marks images with it
    config = transformers.LlavaConfig(text_config=text, vision_config=TOWER, image_token_id=image_token,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    with torch.device("meta"):
        skeleton = transformers.LlavaForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, text.get("dtype") or "bfloat16")  # one dtype for the whole checkpoint, the text model's
    shard: dict[str, torch.Tensor] = {}
    for name, param in skeleton.named_parameters():  # the tower and projector: random, 0.3B parameters
        if ".language_model." in name or name.startswith("lm_head"):
            continue
        std = 0.02 if param.dim() > 1 else 0.0
        tensor = torch.randn(param.shape, generator=generator) * std if std else \
            (torch.ones(param.shape) if name.endswith("weight") else torch.zeros(param.shape))
        shard[name] = tensor.to(dtype)
    save_file(shard, str(out / "model-00000.safetensors"))
    weight_map.update(dict.fromkeys(shard, "model-00000.safetensors"))
    files = sorted(text_dir.glob("*.safetensors"))
    for index, file in enumerate(files, 1):  # the text model's tensors, renamed, one shard per source shard
        shard = {}
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                new = key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
                shard[new] = handle.get_tensor(key)
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(out / name))
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out)
    transformers.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}) \
        .save_pretrained(out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (text_dir / extra).is_file():
            (out / extra).write_bytes((text_dir / extra).read_bytes())
    print(f"wrote {out}: text model of {text_dir}, LLaVA-1.5's tower (random), image token {image_token}")


def measure(hf_dir: Path, export_dir: Path, rounds: int) -> dict:
    import torch
    from PIL import Image

    from kvforge.exporter.vision import load_vision_language_model
    from kvforge.models.vision_families import image_features
    from kvforge.runtime import Generator
    from kvforge.runtime.backends.vision_encoder import VisionEncoder
    from kvforge.runtime.media.preprocess import preprocess

    torch.set_num_threads(2)
    gen = Generator(export_dir, threads=2)
    encoder = VisionEncoder(export_dir, gen.manifest, threads=2)
    model = load_vision_language_model(hf_dir, "fp32")
    image = Image.fromarray((np.random.RandomState(0).rand(480, 640, 3) * 255).astype(np.uint8))
    pixels = preprocess(image, gen.manifest["vision"]["processor"])
    ort_s, hf_s, with_image, without = [], [], [], []
    prompt = "Describe <image> in one sentence."
    tokens = gen.manifest["vision"]["tokens_per_image"]
    # The same prompt without the image: its ids, the image's tokens replaced by a text token (the same length).
    image_ids, _, _ = gen.prompt_inputs(gen.request(prompt, images=[image]))
    token = gen.manifest["vision"]["image_token_id"]
    text_only = [[i if i != token else 1000 for i in image_ids[0]]]
    for _ in range(rounds):
        began = time.perf_counter()
        ours = encoder.encode(pixels)
        ort_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        with torch.no_grad():
            theirs = image_features(model, torch.from_numpy(pixels)[None]).numpy()
        hf_s.append(time.perf_counter() - began)
        gen.images._kept.clear()  # each round encodes the image again
        with_image.append(gen.generate(prompt, images=[image], max_new_tokens=1, greedy=True).ttft_ms)
        without.append(gen.generate(text_only, max_new_tokens=1, greedy=True).ttft_ms)
    return {
        "tokens_per_image": tokens, "features_max_abs_diff": float(np.abs(ours - theirs).max()),
        "vision_onnx_ms": round(statistics.median(ort_s) * 1e3, 1), "hf_eager_ms": round(statistics.median(hf_s) * 1e3, 1),
        "vision_speedup_vs_hf": round(statistics.median(hf_s) / statistics.median(ort_s), 3),
        "ttft_with_image_ms": round(statistics.median(with_image), 1),
        "ttft_same_length_without_image_ms": round(statistics.median(without), 1),
        "prompt_tokens": len(text_only[0]), "rounds": rounds,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("text_dir", type=Path)
    made.add_argument("out", type=Path)
    measured = sub.add_parser("measure")
    measured.add_argument("hf_dir", type=Path)
    measured.add_argument("export_dir", type=Path)
    measured.add_argument("--rounds", type=int, default=5)
    measured.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.text_dir, args.out)
        return
    result = measure(args.hf_dir, args.export_dir, args.rounds)
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
