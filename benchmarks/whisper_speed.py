"""Whisper's encoder time and decoder tokens/s, kvforge's export against Hugging Face eager (and, with `--optimum`,
optimum's ONNX export), alternating, medians.

    python benchmarks/whisper_speed.py make base /tmp/wb/hf          # the Whisper-base shape, random weights (290 MB)
    kvforge export /tmp/wb/hf -o /tmp/wb/ort
    python benchmarks/whisper_speed.py time /tmp/wb/ort /tmp/wb/hf --rounds 3 --tokens 64
    python benchmarks/whisper_speed.py batch /tmp/wb/ort --requests 8     # the server's batching: 8 decodes at once

    # optimum's side: optimum-onnx needs transformers<4.58, so it exports from a venv of its own (a checkpoint saved
    # by transformers 5.x loads there); the timing itself runs here, through onnxruntime alone
    python3 -m venv /tmp/optvenv && /tmp/optvenv/bin/pip install torch==2.13.0
    /tmp/optvenv/bin/pip install optimum-onnx==0.1.0 "transformers==4.57.*" onnxruntime onnx
    /tmp/optvenv/bin/optimum-cli export onnx --model /tmp/wb/hf --task automatic-speech-recognition-with-past \
        /tmp/wb/optimum
    python benchmarks/whisper_speed.py time /tmp/wb/ort /tmp/wb/hf --rounds 3 --tokens 64 --optimum /tmp/wb/optimum

THE WEIGHTS ARE transformers' OWN RANDOM INITIALISATION (seed 0): the time does not depend on the values (the tiny
checkpoints' tests check those). Every side decodes greedily after the same task prompt with the same rules for
`--tokens` tokens (end tokens suppressed, so that all run the same number of steps), from the same 30 s window of
features; Hugging Face's side is `generate` with its cache (eager attention, fp32), kvforge's the Seq2SeqGenerator
(encoder once, cross keys and values bound once, self cache in place), optimum's its graphs fed as its runtime
feeds them (OptimumWhisper). Two threads each. kvforge's encoder also projects the cross keys and values; Hugging
Face's and optimum's compute them in the decoder's first step, so their decode time holds that work instead.
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


class OptimumWhisper:
    """optimum's exported Whisper graphs, run through plain onnxruntime the way optimum-onnx 0.1.0's
    ORTModelForSpeechSeq2Seq (ORTModelForWhisper) runs them by default on CPU, mirrored from its
    onnxruntime/modeling_seq2seq.py and base.py:

    - the files: encoder_model.onnx, and decoder_model_merged.onnx where the export has it (`use_merged` defaults to
      it), else decoder_model.onnx for the first step and decoder_with_past_model.onnx after; one InferenceSession
      each on the CPU provider, default session options but for the thread count;
    - no IO binding (`use_io_binding` is None, so False for every provider but CUDA's): each step is
      `session.run(None, feeds)` on a dict of numpy arrays, every input of the graph fed (torch tensors through
      `.numpy()`, which shares their memory: nothing more is copied there than here), every output fetched as a new
      numpy array;
    - the first step reads the whole prompt with `use_cache_branch` False and every `past_key_values.*` input an
      empty [B, heads, 0, head_dim] array; it returns logits [B, prompt, V], the self keys and values and the cross
      keys and values (present.*.encoder.*), which are kept for every later step;
    - each later step feeds the step's token alone with `use_cache_branch` True, `encoder_hidden_states` again (the
      merged graph's input, read only by its first branch), the previous step's present.*.decoder.* as
      past_key_values.*.decoder.* and the kept cross keys and values; the graph re-emits the whole self cache,
      grown by one position (a new array each step), logits [B, 1, V], and empty placeholders for the cross
      outputs (0-sized, ignored).

    The token is picked from the last position's logits with the end tokens masked (argmax), like the other sides.
    NOT mirrored: the transformers `generate` loop around optimum's graphs (logits processors and stopping criteria
    on torch tensors, a few ms a token on 2 cores), nor its torch OpenMP threads, which spin after each of those
    ops while ONNX Runtime's own threads run: this side is optimum's graphs and its way of feeding them, what an
    application that drives those graphs itself would get."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads

        def session(name: str) -> tuple[Any, list[str], list[str]]:  # with its input and output names, read once
            opened = ort.InferenceSession(str(folder / name), options, providers=["CPUExecutionProvider"])
            return opened, [i.name for i in opened.get_inputs()], [o.name for o in opened.get_outputs()]

        self.encoder = session("encoder_model.onnx")[0]
        if (folder / "decoder_model_merged.onnx").exists():
            self.first = self.later = session("decoder_model_merged.onnx")
        else:
            self.first, self.later = session("decoder_model.onnx"), session("decoder_with_past_model.onnx")
        self.past = [i for i in self.later[0].get_inputs() if i.name.startswith("past_key_values.")]
        self.heads, self.head_dim = self.past[0].shape[1], self.past[0].shape[3]

    def encode(self, features: Any) -> Any:
        return self.encoder.run(None, {"input_features": features})[0]

    @staticmethod
    def _step(graph: tuple[Any, list[str], list[str]], feeds: dict[str, Any]) -> dict[str, Any]:
        session, inputs, outputs = graph
        return dict(zip(outputs, session.run(None, {name: feeds[name] for name in inputs}), strict=True))

    def generate_ids(self, hidden: Any, tokens: int, prompt: list[int], suppress: list[int]) -> list[int]:
        import numpy as np

        batch = hidden.shape[0]
        empty = np.zeros((batch, self.heads, 0, self.head_dim), np.float32)
        feeds = {"input_ids": np.array([prompt] * batch, np.int64), "encoder_hidden_states": hidden,
                 "use_cache_branch": np.array([False]), **{i.name: empty for i in self.past}}
        out = self._step(self.first, feeds)
        cross = {f"past_key_values.{n[len('present.'):]}": v for n, v in out.items() if ".encoder." in n}
        picked: list[int] = []
        while True:
            logits = out["logits"][0, -1].copy()
            logits[suppress] = -np.inf
            picked.append(int(np.argmax(logits)))
            if len(picked) == tokens:
                return picked
            feeds = {"input_ids": np.array([[picked[-1]]] * batch, np.int64), "encoder_hidden_states": hidden,
                     "use_cache_branch": np.array([True]), **cross,
                     **{f"past_key_values.{n[len('present.'):]}": v for n, v in out.items() if ".decoder." in n}}
            out = self._step(self.later, feeds)


def _sides(export: Path, hf_dir: Path, optimum: Path | None, tokens: int, threads: int) -> tuple[Any, dict]:
    """The 30 s features, and each side's (encode, decode) pair: encode(features) -> state, decode(state) -> ids."""
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

    def hf_encode(feats: Any) -> Any:
        with torch.no_grad():
            return model.get_encoder()(torch.from_numpy(feats)).last_hidden_state

    def hf_decode(states: Any) -> list[int]:
        with torch.no_grad():
            out = GenerationMixin.generate(model, encoder_outputs=(states,), decoder_input_ids=torch.tensor([prompt]),
                                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1,
                                           suppress_tokens=[eos], begin_suppress_tokens=None)
        return out[0, len(prompt):].tolist()

    sides = {"kvforge": (generator.encode_features,
                         lambda encoded: generator.generate_ids(encoded, tokens, prompt=prompt, rules=rules)[0]),
             "hf": (hf_encode, hf_decode)}
    if optimum is not None:
        ours = OptimumWhisper(optimum, threads)
        sides["optimum"] = (ours.encode, lambda hidden: ours.generate_ids(hidden, tokens, prompt, [eos]))
    return features, sides


def time_sides(export: Path, hf_dir: Path, rounds: int, tokens: int, threads: int,
               optimum: Path | None = None) -> dict[str, Any]:
    features, sides = _sides(export, hf_dir, optimum, tokens, threads)
    times: dict[str, list[float]] = {f"{side}_{part}": [] for side in sides for part in ("encode", "decode")}
    produced: dict[str, list[list[int]]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, (encode, decode) in sides.items():
            start = time.perf_counter()
            state = encode(features)
            times[f"{side}_encode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            produced[side].append(decode(state))
            times[f"{side}_decode"].append(time.perf_counter() - start)
    medians = {name: _median_ms(values) for name, values in times.items()}
    result: dict[str, Any] = {**medians}
    for side in sides:
        result[f"{side}_tokens_per_s"] = round(tokens / (medians[f"{side}_decode"] / 1e3), 1)
    result["encode_speedup"] = round(medians["hf_encode"] / medians["kvforge_encode"], 2)
    result["decode_speedup"] = round(medians["hf_decode"] / medians["kvforge_decode"], 2)
    result["same_tokens"] = produced["hf"] == produced["kvforge"]
    if optimum is not None:
        result["encode_speedup_vs_optimum"] = round(medians["optimum_encode"] / medians["kvforge_encode"], 2)
        result["decode_speedup_vs_optimum"] = round(medians["optimum_decode"] / medians["kvforge_decode"], 2)
        result["optimum_same_tokens"] = produced["optimum"] == produced["kvforge"]
    return {**result, "rounds": rounds, "tokens": tokens, "threads": threads}


def time_batching(export: Path, requests: int, rounds: int, tokens: int, threads: int) -> dict[str, Any]:
    """`requests` concurrent decodes of `tokens` tokens (each its own window, encoded beforehand) through the server's
    Seq2SeqBatcher, with `max_rows` 1 (one at a time) and `requests` (all together), alternating; medians."""
    import threading

    import numpy as np

    from kvforge.runtime.drivers.seq2seq import DecodingRules, Seq2SeqGenerator
    from kvforge.runtime.drivers.seq2seq_batch import Seq2SeqBatcher

    generator = Seq2SeqGenerator(export, threads=threads)
    bins, frames = generator.record.features["feature_size"], generator.record.features["nb_max_frames"]
    encoded = [generator.encode_features(np.random.default_rng(i).standard_normal((1, bins, frames), np.float32))
               for i in range(requests)]
    # the start token and <|notimestamps|>, as `time`'s prompt
    no_timestamps = (generator.manifest.get("generation") or {})["no_timestamps_token_id"]
    prompt = [generator.record.decoder_start_token_id, no_timestamps]
    rules = DecodingRules(suppress=generator.rules.eos)
    seconds: dict[int, list[float]] = {1: [], requests: []}
    outputs: dict[int, list[Any]] = {}
    for _ in range(rounds):
        for rows in seconds:
            batcher, out = Seq2SeqBatcher(generator, max_rows=rows), [None] * requests

            def call(i: int, batcher: Any = batcher, out: list[Any] = out) -> None:
                out[i] = batcher.generate_ids(encoded[i], tokens, prompt=prompt, rules=rules)[0]

            started = time.perf_counter()
            workers = [threading.Thread(target=call, args=(i,)) for i in range(requests)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            seconds[rows].append(time.perf_counter() - started)
            batcher.close()
            outputs[rows] = out
    alone, together = (statistics.median(seconds[rows]) for rows in seconds)
    return {"requests": requests, "tokens": tokens, "one_at_a_time_s": round(alone, 3),
            "batched_s": round(together, 3), "one_at_a_time_tokens_per_s": round(requests * tokens / alone, 1),
            "batched_tokens_per_s": round(requests * tokens / together, 1), "speedup": round(alone / together, 2),
            "same_tokens": outputs[1] == outputs[requests], "rounds": rounds, "threads": threads}


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
    timed.add_argument("--optimum", type=Path, default=None, help="optimum's export of the same checkpoint: a third side")
    batched = sub.add_parser("batch")
    batched.add_argument("export", type=Path)
    batched.add_argument("--requests", type=int, default=8)
    batched.add_argument("--rounds", type=int, default=3)
    batched.add_argument("--tokens", type=int, default=64)
    batched.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.command == "make":
        make(args.shape, args.out)
    elif args.command == "batch":
        print(json.dumps(time_batching(args.export, args.requests, args.rounds, args.tokens, args.threads), indent=2))
    else:
        print(json.dumps(time_sides(args.export, args.hf_dir, args.rounds, args.tokens, args.threads, args.optimum),
                         indent=2))


if __name__ == "__main__":
    main()
