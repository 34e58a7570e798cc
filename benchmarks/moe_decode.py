"""Decode and prefill speed of a Qwen3-MoE-shaped model (2 of 8 experts per token) in three exports:

- `moe-op`: as kvforge exports it on `ort`: the canonical MoE node lowered to ONNX Runtime's MoE op;
- `gather`: each token's top-k experts' weights gathered and run (the plain-ONNX form the `onnx` and
  `trt` targets use, here on `ort` so only the experts differ);
- `dense`: every expert runs on every token, weighted by zero where not picked;
- `moe-op-int4`: `moe-op` with `--quantize int4` (ONNX Runtime's QMoE for the experts, MatMulNBits for
  the rest).

    python benchmarks/moe_decode.py [--rounds 5] [--new-tokens 64] [--prompt 512] [--layers 4] [--hidden 1024]

Random weights (seeded), fp32, `ort` target, batch 1, all exports in this process, alternating round by
round; the figures are medians of per-round tokens/s and of per-round ratios to `dense`. Decode runs
after a 32-token prompt; prefill is timed on a `--prompt`-token prompt. The variants differ only in
their experts (the function swapped for the export), and the three fp32 ones give the same greedy tokens.
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


def export(hf_dir: Path, out: Path, variant: str) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from kvforge.exporter import experts_routing
    from kvforge.exporter.export import export_model

    saved, gate_form = ALL_EXPERTS_FUNCTIONS["batched_mm"], experts_routing._gate_form
    if not variant.startswith("moe-op"):  # no module is taken for the node: they keep the "batched_mm" form
        experts_routing._gate_form = lambda module, width: None
    if variant == "dense":  # ... and "batched_mm" is the dense function
        ALL_EXPERTS_FUNCTIONS["batched_mm"] = dense_experts_forward
    try:
        export_model(hf_dir, out, target="ort", force=True, quantize="int4" if variant.endswith("int4") else None,
                     quant_method="rtn" if variant.endswith("int4") else None)
    finally:
        ALL_EXPERTS_FUNCTIONS["batched_mm"], experts_routing._gate_form = saved, gate_form


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens for the prefill timing")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()

    from kvforge.runtime import Generator

    variants = ("moe-op", "gather", "dense", "moe-op-int4")
    with tempfile.TemporaryDirectory(prefix="kvforge-moe-") as tmp:
        hf_dir = Path(tmp) / "hf"
        build(hf_dir, args.layers, args.hidden)
        for name in variants:
            export(hf_dir, Path(tmp) / name, name)
        generators = {name: Generator(Path(tmp) / name) for name in variants}
        prompt = [[(7 * i) % 8000 + 3 for i in range(32)]]
        long_prompt = [[(11 * i) % 8000 + 3 for i in range(args.prompt)]]
        tokens = {name: g.generate(prompt, max_new_tokens=args.new_tokens, greedy=True, ignore_eos=True).tokens
                  for name, g in generators.items()}
        assert tokens["moe-op"] == tokens["gather"] == tokens["dense"], "the fp32 exports disagree"
        decode = {name: [] for name in variants}
        prefill = {name: [] for name in variants}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for name in order:
                result = generators[name].generate(prompt, max_new_tokens=args.new_tokens, greedy=True,
                                                   ignore_eos=True)
                decode[name].append((args.new_tokens - 1) / (result.decode_ms / 1e3))
                result = generators[name].generate(long_prompt, max_new_tokens=1, greedy=True, ignore_eos=True)
                prefill[name].append(args.prompt / (result.prefill_ms / 1e3))
            print(f"round {round_ + 1}: decode tok/s " + ", ".join(f"{n} {decode[n][-1]:.1f}" for n in variants)
                  + "; prefill tok/s " + ", ".join(f"{n} {prefill[n][-1]:.0f}" for n in variants), flush=True)

        def ratio(rates: dict[str, list[float]], name: str, base: str) -> str:
            return f"{statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True)):.2f}x"

        print(f"{args.layers} layers, hidden {args.hidden}, 2 of 8 experts, {args.prompt}-token prefill; medians over "
              f"{args.rounds} rounds")
        print("| Export | decode tok/s | vs gather | vs dense | prefill tok/s | vs gather | vs dense |")
        print("|---|---|---|---|---|---|---|")
        for name in variants:
            print(f"| `{name}` | {statistics.median(decode[name]):.1f} | {ratio(decode, name, 'gather')} | "
                  f"{ratio(decode, name, 'dense')} | {statistics.median(prefill[name]):.0f} | "
                  f"{ratio(prefill, name, 'gather')} | {ratio(prefill, name, 'dense')} |")


if __name__ == "__main__":
    main()
