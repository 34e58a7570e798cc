"""A random-weight Hugging Face Llama checkpoint with the exact tensor shapes of a real model.

Real sizes (1-8B) are what an export must stream; nothing can be downloaded here, so this writes the
shape with seeded random weights (THE TEXT IT MAKES IS NOISE). Making one never holds the model, nor
even a shard: every shard's safetensors header is known from the shapes up front, so each tensor is
generated in chunks and streamed into the file after the header (safetensors' save_file would hold the
whole shard). The memory beyond the imports (~0.5 GB for torch and transformers) is one chunk, ~100 MB,
whatever the size: Llama-3.2-1B's 2.5 GB are made with a peak RSS of 0.66 GB.

    python benchmarks/make_real_shape.py llama-3.2-1b /tmp/llama-1b-shape            # fp16; --dtype bf16 as released
    python benchmarks/make_real_shape.py llama-3.1-8b /data/llama-8b-shape --shard-gb 5   # ~16 GB of disk

The folder (config.json, generation_config.json, model*.safetensors, the index when sharded, a locally
built tokenizer) is written to a hidden sibling and renamed into place, and loads with
`AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError, KvforgeError
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk, require_free_space
from kvforge.models.safetensors_shards import plan_shards, write_checkpoint

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
               bos_token_id=128000, eos_token_id=128001)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, **_LLAMA3),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, **_LLAMA3),
}
DTYPES = {"fp16": ("float16", "F16"), "bf16": ("bfloat16", "BF16")}
MARKER = "kvforge_real_shape.json"
STD = 0.02
# Elements generated at once (64 MB of float32, then its half-precision copy): the peak memory of a write.
CHUNK_ELEMENTS = 16 << 20
# Names of the special tokens added to the local tokenizer when the model's ids lie beyond its vocabulary.
BOS_NAME, EOS_NAME = "<|begin_of_text|>", "<|end_of_text|>"


@dataclass(frozen=True)
class Planned:
    index: int  # its place in the state dict: seeds its values
    name: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int


def build_config(shape: dict[str, Any], dtype: str) -> Any:
    """The LlamaConfig of a shape, weights declared in `dtype` ('fp16' / 'bf16')."""
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, dtype=DTYPES[dtype][0])
    config.architectures = ["LlamaForCausalLM"]
    return config


def tensor_plan(config: Any, dtype: str) -> list[Planned]:
    """The tensors save_pretrained writes for this config, in state-dict order, from a model built on the meta
    device (no memory): a tied lm_head is not saved."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    itemsize = getattr(torch, DTYPES[dtype][0]).itemsize
    plan = []
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        plan.append(Planned(len(plan), name, tuple(tensor.shape), tensor.numel(), tensor.numel() * itemsize))
    return plan


def chunks(tensor: Planned, dtype: str, seed: int) -> Iterator[Any]:
    """The tensor's values, row blocks at a time: ones for a norm's weight, else N(0, 0.02) from a generator
    seeded by seed + its index (reproducible for a given seed, whatever the shard size)."""
    import torch

    torch_dtype = getattr(torch, DTYPES[dtype][0])
    if tensor.name.endswith("norm.weight"):
        yield torch.ones(tensor.shape, dtype=torch_dtype)
        return
    generator = torch.Generator().manual_seed(seed + tensor.index)
    rows = tensor.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, tensor.numel // max(1, rows)))
    for start in range(0, rows, step):
        block = (min(step, rows - start), *tensor.shape[1:])
        yield torch.empty(block, dtype=torch.float32).normal_(0.0, STD, generator=generator).to(torch_dtype)


class Progress:
    """A line at most every second: tensors done and GB written."""

    def __init__(self, total_tensors: int, total_bytes: int, say: Callable[[str], None]) -> None:
        self.total_tensors, self.total_bytes, self.say = total_tensors, total_bytes, say
        self.tensors = self.bytes = 0
        self.started = self.last = time.monotonic()

    def __call__(self, tensor: Planned) -> None:
        self.tensors += 1
        self.bytes += tensor.nbytes
        now = time.monotonic()
        if now - self.last >= 1.0 or self.tensors == self.total_tensors:
            self.last = now
            self.say(f"[{self.tensors}/{self.total_tensors} tensors] {self.bytes / 1e9:.2f}/"
                     f"{self.total_bytes / 1e9:.2f} GB written ({now - self.started:.0f} s)")


def write_tokenizer(folder: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """tokenizer.json + tokenizer_config.json from the project's local BPE (models/tokenizer.py), with the
    model's bos/eos ids: tokens the BPE has at those ids are used, others are added at exactly those ids."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from kvforge.models.tokenizer import build_tokenizer

    spec = json.loads(build_tokenizer(min(512, vocab_size)).to_str())
    by_id = {token["id"]: token["content"] for token in spec["added_tokens"]}
    highest = max(spec["model"]["vocab"].values())
    if highest >= vocab_size:
        raise InputError(f"the shape's vocabulary ({vocab_size}) is smaller than the local tokenizer's "
                         f"({highest + 1}); give vocab_size >= 512")
    names = []
    for token_id, fallback in ((bos_id, BOS_NAME), (eos_id, EOS_NAME)):
        if not 0 <= token_id < vocab_size:
            raise InputError(f"the token id {token_id} is outside the model's vocabulary (0..{vocab_size - 1})")
        if token_id not in by_id:
            if token_id in spec["model"]["vocab"].values():
                raise InputError(f"the token id {token_id} is an ordinary token of the local tokenizer; give "
                                 f"bos/eos ids below 4 (its special tokens) or above {highest}")
            by_id[token_id] = fallback
            spec["model"]["vocab"][fallback] = token_id
            spec["added_tokens"].append({"id": token_id, "content": fallback, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
        names.append(by_id[token_id])
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    bos = names[0]
    tokenizer.post_processor = processors.TemplateProcessing(  # Llama-style: bos first
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=names[0], eos_token=names[1]).save_pretrained(folder)


def make_checkpoint(name: str, out_dir: Path, dtype: str = "bf16", shard_gb: float = 2.0, seed: int = 0,
                    force: bool = False, shape: dict[str, Any] | None = None,
                    say: Callable[[str], None] = print) -> Path:
    """Write the shape `name` (or the custom `shape`, LlamaConfig fields) as a Hugging Face folder at
    `out_dir`; replaces only a folder this script wrote (with `force`)."""
    from transformers import GenerationConfig

    record: dict[str, Any] = {"shape": name}
    if shape is None:
        if name not in SHAPES:
            raise InputError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
        shape = SHAPES[name]
    else:
        name, record = "a custom shape", {"shape": "custom", "config": shape}
    out_dir = Path(out_dir).absolute()
    check_output(out_dir, [], force=force, marker=MARKER, what="real-shape checkpoint")
    config = build_config(shape, dtype)
    plan = tensor_plan(config, dtype)
    shards = plan_shards(plan, int(shard_gb * 1e9))
    total = sum(tensor.nbytes for tensor in plan)
    say(f"{name}: {len(plan)} tensors, {total / 1e9:.2f} GB in {len(shards)} shard(s), "
        f"{DTYPES[dtype][0]}, seed {seed} -> {out_dir}")
    require_free_space(out_dir.parent, total, f"the checkpoint of {name}")
    progress = Progress(len(plan), total, say)
    with naming_a_full_disk(out_dir), StagedFolder(out_dir, MARKER, what="real-shape checkpoint") as staged:
        staging = staged.path
        assert staging is not None
        # The small files first: a bad token id fails before minutes of weights.
        write_tokenizer(staging, config.vocab_size, config.bos_token_id, config.eos_token_id)
        config.save_pretrained(staging)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(staging)
        write_checkpoint(staging, plan, DTYPES[dtype][1], lambda tensor: chunks(tensor, dtype, seed),
                         int(shard_gb * 1e9), progress)
        (staging / MARKER).write_text(json.dumps(
            {**record, "dtype": dtype, "seed": seed, "random_weights": True, "bytes": total}, indent=2) + "\n")
        staged.publish()
    return out_dir


def peak_rss_gb() -> float:
    """This process's peak resident memory (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="largest shard, GB (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace a folder this script wrote before")
    # For tests: a JSON object of LlamaConfig fields that replaces the named shape's.
    parser.add_argument("--shape-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        try:
            shape = json.loads(args.shape_json) if args.shape_json else None
        except ValueError as err:
            raise InputError(f"--shape-json is not JSON: {err}") from err
        if args.shard_gb <= 0:
            raise InputError(f"--shard-gb must be positive, got {args.shard_gb}")
        started = time.monotonic()
        folder = make_checkpoint(args.shape, args.out_dir, args.dtype, args.shard_gb, args.seed, args.force, shape)
    except (KvforgeError, ValueError) as err:  # ValueError: a bad --shape-json or LlamaConfig field
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"wrote {folder} in {time.monotonic() - started:.1f} s; peak RSS {peak_rss_gb():.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
