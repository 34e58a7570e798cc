"""Decode speed of a Qwen3-MoE-shaped model (2 of 8 experts per token), exported as kvforge exports it
(each token's top-k experts gathered and run: transformers' "batched_mm" experts) against the same
model with dense expert compute (every expert runs for every token, weighted by zero where not picked).

    python benchmarks/moe_decode.py [--rounds 5] [--new-tokens 64] [--layers 4] [--hidden 1024]

Random weights (seeded), fp32, `ort` target, batch 1, both exports in this process, alternating
round by round; the figure is the median of the per-round ratios of decode tokens/s. The dense
baseline is built by swapping the experts function for the export only: the graphs differ in
nothing else, and both are checked to give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; the routing weights (zero for experts not picked) mix them."""
    experts = self.gate_up_proj.shape[0]
    mix = torch.zeros(hidden_states.shape[0], experts, dtype=hidden_states.dtype)
    mix = mix.scatter(1, top_k_index, top_k_weights.to(hidden_states.dtype))  # [T, E]
    # matmul against transposed initializers (folded once by ONNX Runtime), not einsum: a fair dense graph.
    gate_up = torch.matmul(hidden_states.unsqueeze(0), self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
    inner = self._apply_gate(gate_up)  # [E, T, I]
    out = torch.matmul(inner, self.down_proj.transpose(1, 2))  # [E, T, H]
    return (out * mix.t().unsqueeze(-1)).sum(0)


def build(folder: Path, layers: int, hidden: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from kvforge.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=8192, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=hidden // 16, moe_intermediate_size=768, intermediate_size=3072,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(8192), bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token=None).save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(folder)


def export(hf_dir: Path, out: Path, dense: bool) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from kvforge.exporter.export import export_model

    saved = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    if dense:  # the exporter asks for "batched_mm": give it the dense function under that name
        ALL_EXPERTS_FUNCTIONS["batched_mm"] = dense_experts_forward
    try:
        export_model(hf_dir, out, target="ort", force=True)
    finally:
        ALL_EXPERTS_FUNCTIONS["batched_mm"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()

    from kvforge.runtime import Generator

    with tempfile.TemporaryDirectory(prefix="kvforge-moe-") as tmp:
        hf_dir = Path(tmp) / "hf"
        build(hf_dir, args.layers, args.hidden)
        exports = {"top-k": Path(tmp) / "topk", "dense": Path(tmp) / "dense"}
        for name, out in exports.items():
            export(hf_dir, out, dense=name == "dense")
        generators = {name: Generator(out) for name, out in exports.items()}
        prompt = [[(7 * i) % 8000 + 3 for i in range(32)]]
        tokens = {name: g.generate(prompt, max_new_tokens=args.new_tokens, greedy=True, ignore_eos=True).tokens
                  for name, g in generators.items()}
        assert tokens["top-k"] == tokens["dense"], "the dense and top-k exports disagree"
        ratios, rates = [], {name: [] for name in generators}
        for round_ in range(args.rounds):
            order = list(generators) if round_ % 2 == 0 else list(reversed(generators))
            for name in order:
                result = generators[name].generate(prompt, max_new_tokens=args.new_tokens, greedy=True,
                                                   ignore_eos=True)
                rates[name].append((args.new_tokens - 1) / (result.decode_ms / 1e3))
            ratios.append(rates["top-k"][-1] / rates["dense"][-1])
            print(f"round {round_ + 1}: top-k {rates['top-k'][-1]:.1f} tok/s, dense {rates['dense'][-1]:.1f} tok/s, "
                  f"ratio {ratios[-1]:.2f}", flush=True)
        print(f"median decode tok/s: top-k {statistics.median(rates['top-k']):.1f}, dense "
              f"{statistics.median(rates['dense']):.1f}; median ratio {statistics.median(ratios):.2f}x "
              f"({args.layers} layers, hidden {args.hidden}, 2 of 8 experts, {args.new_tokens} new tokens)")


if __name__ == "__main__":
    main()
