"""Whisper's encoder time and decoder tokens/s, kvforge's export against Hugging Face eager, alternating, medians.

    python benchmarks/whisper_speed.py make base /tmp/wb/hf          # the Whisper-base shape, random weights (290 MB)
    kvforge export /tmp/wb/hf -o /tmp/wb/ort
    python benchmarks/whisper_speed.py time /tmp/wb/ort /tmp/wb/hf --rounds 3 --tokens 64

THE WEIGHTS ARE transformers' OWN RANDOM INITIALISATION (seed 0): the time does not depend on the values (the tiny
checkpoints' tests check those). Both sides decode greedily after the same task prompt with the same rules for
`--tokens` tokens (end tokens suppressed, so that both run the same number of steps), from the same 30 s window of
features; Hugging Face's side is `generate` with its cache (eager attention, fp32), kvforge's the Seq2SeqGenerator
(encoder once, cross keys and values bound once, self cache in place). Two threads each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SHAPES = {  # openai/whisper-* configs' sizes
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                 encoder_ffn_dim=2048, decoder_ffn_dim=2048, num_mel_bins=80, vocab_size=51865),
    "large-v3": dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                     decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128,
                     vocab_size=51866),
}


def make(shape: str, out: Path) -> None:
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(**SHAPES[shape], max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50257, bos_token_id=50257)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config.no_timestamps_token_id = 50363
    model.generation_config._from_model_config = False
    model.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(out)


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def time_both(export: Path, hf_dir: Path, rounds: int, tokens: int, threads: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import GenerationMixin, WhisperForConditionalGeneration

    from kvforge.runtime.drivers.seq2seq import DecodingRules, Seq2SeqGenerator

    torch.set_num_threads(threads)
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager").eval()
    generator = Seq2SeqGenerator(export, threads=threads)
    config = model.config
    features = np.random.default_rng(0).standard_normal((1, config.num_mel_bins, 3000)).astype(np.float32)
    prompt = [config.decoder_start_token_id, model.generation_config.no_timestamps_token_id]
    eos = config.eos_token_id
    rules = DecodingRules(suppress=(eos,))
    times: dict[str, list[float]] = {k: [] for k in ("kvforge_encode", "kvforge_decode", "hf_encode", "hf_decode")}
    same = True
    for _ in range(rounds):
        start = time.perf_counter()
        encoded = generator.encode_features(features)
        times["kvforge_encode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        ours = generator.generate_ids(encoded, tokens, prompt=prompt, rules=rules)[0]
        times["kvforge_decode"].append(time.perf_counter() - start)
        with torch.no_grad():
            start = time.perf_counter()
            states = model.get_encoder()(torch.from_numpy(features)).last_hidden_state
            times["hf_encode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out = GenerationMixin.generate(model, encoder_outputs=(states,), decoder_input_ids=torch.tensor([prompt]),
                                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1,
                                           suppress_tokens=[eos], begin_suppress_tokens=None)
            times["hf_decode"].append(time.perf_counter() - start)
        same = same and out[0, len(prompt):].tolist() == ours
    medians = {name: _median_ms(values) for name, values in times.items()}
    return {**medians, "kvforge_tokens_per_s": round(tokens / (medians["kvforge_decode"] / 1e3), 1),
            "hf_tokens_per_s": round(tokens / (medians["hf_decode"] / 1e3), 1),
            "encode_speedup": round(medians["hf_encode"] / medians["kvforge_encode"], 2),
            "decode_speedup": round(medians["hf_decode"] / medians["kvforge_decode"], 2),
            "same_tokens": same, "rounds": rounds, "tokens": tokens, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("shape", choices=sorted(SHAPES))
    made.add_argument("out", type=Path)
    timed = sub.add_parser("time")
    timed.add_argument("export", type=Path)
    timed.add_argument("hf_dir", type=Path)
    timed.add_argument("--rounds", type=int, default=3)
    timed.add_argument("--tokens", type=int, default=64)
    timed.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.command == "make":
        make(args.shape, args.out)
    else:
        print(json.dumps(time_both(args.export, args.hf_dir, args.rounds, args.tokens, args.threads), indent=2))


if __name__ == "__main__":
    main()
