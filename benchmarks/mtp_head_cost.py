"""What a checkpoint's MTP layer costs per drafted token, as a share of one target decode step, at a 1B shape on
this CPU (issue 54 asks a head for <= 15% of a step at the 1B shape); the same method as
benchmarks/eagle3_head_cost.py, whose functions this reuses (the making steps in a memory cap, the alternating
timing in a speculation loop's order, medians of rounds, both spinning modes).

The family is GLM-4.5's (`glm4_moe`): its MTP layer is a plain GQA decoder layer (partial rotary), which exports
for ONNX Runtime at any head size that is a multiple of 8 (kvforge/data/coverage.json: glm4_moe passes `ort`),
and its config can keep all but the last layer dense (`first_k_dense_replace`), so the target is Llama-3.2-1B's
step with one MoE layer. DeepSeek-V3's layer brings MLA, whose shape at 1B would be an invention of ours (its
latent ranks), and Qwen3-Next's target is mostly linear attention (not a Llama-1B step). The checkpoint: hidden
2048, 16 layers, 32 heads / 8 KV heads of 64, dense MLP 8192, vocabulary 128256, tied embeddings (as Llama-3.2-1B:
a decode step reads the lm_head whole and one embedding row either way), GLM-4.5's attention (q/k/v bias, half
rotary, theta 1e6); layers 0-14 dense, layer 15 a MoE of 8 experts of 2048, top-3, plus 1 shared expert (the
active MLP width 4 x 2048 = the dense 8192). Its weights are streamed into one model.safetensors (fp16, seeded
N(0, 0.02), norms 1: benchmarks/make_real_shape.py's `chunks`, which hold one block at a time), then
models/mtp_fixture.py's add_mtp_layers writes one MTP layer (a copy of layer 15's shapes, the MoE: as GLM-4.5's
MTP layer is one of its MoE layers) with its own embedding and FULL-VOCABULARY shared head, as GLM-4.5 ships.

Exported for ONNX Runtime with the MTP layer (draft.onnx beside the target) and with --no-mtp, each export under
/usr/bin/time -v in the memory cap; then timed as eagle3_head_cost.py times (its module docstring: the runtime's
LoadedExport and HeadRunner, no torch in the timing).

    python benchmarks/mtp_head_cost.py --work /tmp/mtp-1b --json benchmarks/results/mtp_head_cost_1b.json

Shares: head_step_share = the MTP layer's S=1 call (a drafted token) / the with-head target's decode step;
target_hidden_cost = that step / the --no-mtp export's; catch_up_share[S] = its call over S positions / the
target step. weights_share: weight elements read per step at batch 1 (the active ones: the routed experts a token
takes, one row of an embedding; norms and biases of norms left out), MTP layer / target, for the 1B checkpoint
and for the published configs of DeepSeek-V3, GLM-4.5-Air and Qwen3-Next-80B-A3B (PUBLISHED below).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import eagle3_head_cost as eagle  # noqa: E402 - a sibling script, found through HERE

CHECKPOINT = "glm-1b"
FOLDERS = ("ort-mtp", "ort-plain")
MTP_ADDED = "kvforge_mtp_added.json"  # written once add_mtp_layers has rewritten the checkpoint
SHAPE_1B: dict[str, Any] = dict(
    model_type="glm4_moe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, first_k_dense_replace=15,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=2048, n_group=1,
    topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001)
MTP_SCALE = 0.02  # the MTP layer's noise, as the target's (make_real_shape.STD)

# The published configs' fields that set what a decode step reads (config.json of each model on the Hugging Face
# hub, as released; the MTP layer is one more decoder layer of the model's MoE kind, with its own proj and head).
PUBLISHED: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        source="huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (num_nextn_predict_layers 1)",
        model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, vocab_size=129280,
        intermediate_size=18432, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, moe_intermediate_size=2048, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, published_active_b=37),
    "glm-4.5-air": dict(
        source="huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (num_nextn_predict_layers 1)",
        model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, vocab_size=151552, intermediate_size=10944,
        first_k_dense_replace=1, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=1408, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        attention_bias=True, published_active_b=12),
    "qwen3-next-80b-a3b": dict(
        source="huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (one mtp.* layer)",
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, vocab_size=151936,
        full_attention_interval=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, published_active_b=3),
}


# -- weight elements read per decode step ----------------------------------------------------------------------
def attention_elements(c: dict[str, Any]) -> int:
    """One full-attention layer's projections: MLA (q/kv low-rank, DeepSeek-V3) or GQA (Qwen3-Next's q_proj also
    gives the output gate: twice as wide)."""
    h, n = c["hidden_size"], c["num_attention_heads"]
    if "kv_lora_rank" in c:
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q = h * c["q_lora_rank"] + c["q_lora_rank"] * n * qk
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + \
            c["kv_lora_rank"] * n * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv + n * c["v_head_dim"] * h
    kv, d = c["num_key_value_heads"], c["head_dim"]
    gate = 2 if c["model_type"] == "qwen3_next" else 1
    bias = (n + 2 * kv) * d if c.get("attention_bias") else 0
    return h * n * d * gate + 2 * h * kv * d + n * d * h + bias


def linear_attention_elements(c: dict[str, Any]) -> int:
    """One Gated DeltaNet layer of Qwen3-Next: in_proj_qkvz, in_proj_ba, the depthwise conv, out_proj."""
    h = c["hidden_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return h * (2 * kd + 2 * vd) + h * 2 * c["linear_num_value_heads"] + (2 * kd + vd) * c["linear_conv_kernel_dim"] \
        + vd * h


def mlp_elements(c: dict[str, Any], moe: bool) -> int:
    """A dense SwiGLU MLP, or a MoE's router plus the experts one token takes (top-k routed and the shared)."""
    h = c["hidden_size"]
    if not moe:
        return 3 * h * c["intermediate_size"]
    experts = c.get("n_routed_experts") or c["num_experts"]
    shared = c.get("n_shared_experts", 0) * c["moe_intermediate_size"] + c.get("shared_expert_intermediate_size", 0)
    shared_gate = h if "shared_expert_intermediate_size" in c else 0  # Qwen's sigmoid gate on the shared expert
    return experts * h + 3 * h * (c["num_experts_per_tok"] * c["moe_intermediate_size"] + shared) + shared_gate


def step_elements(c: dict[str, Any]) -> dict[str, Any]:
    """Weight elements one decode step reads (batch 1): the target's and its MTP layer's, and the share."""
    h, vocab = c["hidden_size"], c["vocab_size"]
    target = h + vocab * h  # one embedding row, the whole lm_head
    for i in range(c["num_hidden_layers"]):
        if c["model_type"] == "qwen3_next":
            full, moe = (i + 1) % c["full_attention_interval"] == 0, True
        else:
            full, moe = True, i >= c["first_k_dense_replace"]
        target += (attention_elements(c) if full else linear_attention_elements(c)) + mlp_elements(c, moe)
    # proj [H, 2H], one full-attention MoE decoder layer, the full-vocabulary head, one embedding row
    mtp = 2 * h * h + attention_elements(c) + mlp_elements(c, True) + vocab * h + h
    return {"target_weight_elements": target, "mtp_weight_elements": mtp, "share": round(mtp / target, 4),
            "mtp_lm_head_part": round(vocab * h / mtp, 4)}


def weights_shares(ckpt: Path) -> dict[str, Any]:
    """step_elements of the 1B checkpoint (its config.json) and of each published config."""
    config = json.loads((ckpt / "config.json").read_text())
    shares = {"1b_checkpoint": step_elements(config)}
    for name, published in PUBLISHED.items():
        found = step_elements(published)
        shares[name] = {**found, "target_active_b": round(found["target_weight_elements"] / 1e9, 2),
                        "published_active_b": published["published_active_b"], "source": published["source"]}
    return shares


# -- the checkpoint ----------------------------------------------------------------------------------------------
def tensor_plan(config: Any) -> list[Any]:
    """The tensors of the glm4_moe checkpoint in its on-disk form (the experts one tensor per projection and
    expert, as save_pretrained writes them and GLM-4.5 ships them), from a model built on the meta device."""
    import torch
    from make_real_shape import Planned
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate_proj, up_proj [I, H] per expert
            experts, rows, width = tensor.shape
            base = name[:-len("gate_up_proj")]
            shapes += [(f"{base}{e}.{p}.weight", (rows // 2, width)) for e in range(experts) for p in ("gate_proj",
                                                                                                       "up_proj")]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            shapes += [(f"{name[:-len('down_proj')]}{e}.down_proj.weight", tuple(tensor.shape[1:]))
                       for e in range(tensor.shape[0])]
        else:
            shapes.append((name, tuple(tensor.shape)))
    plan = []
    for name, shape in shapes:
        numel = int(torch.Size(shape).numel())
        plan.append(Planned(len(plan), name, shape, numel, numel * 2))  # fp16
    return plan


def make_checkpoint(folder: Path) -> None:
    """SHAPE_1B's checkpoint at `folder`, streamed (one block of one tensor held); config.json last (the step's
    marker)."""
    from make_real_shape import chunks, write_tokenizer
    from transformers import AutoConfig, GenerationConfig

    from kvforge.models.safetensors_shards import write_checkpoint

    fields = {k: v for k, v in SHAPE_1B.items() if k != "model_type"}
    config = AutoConfig.for_model("glm4_moe", **fields, dtype="float16")
    config.architectures = ["Glm4MoeForCausalLM"]
    plan = tensor_plan(config)
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, config.vocab_size, config.bos_token_id, config.eos_token_id)
    total = sum(t.nbytes for t in plan)
    print(f"{len(plan)} tensors, {total / 1e9:.2f} GB -> {folder}", flush=True)
    write_checkpoint(folder, plan, "F16", lambda tensor: chunks(tensor, "fp16", 0), total + 1)  # one file
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(folder)
    config.save_pretrained(folder)


def head_folders(lm_head_bits: int | None) -> tuple[str, str]:
    """The exports timed: with the head (its lm_head at `lm_head_bits`, exported with --draft-lm-head-bits into
    its own folder, ort-mtp8 / ort-mtp4; None: fp32, ort-mtp) and without it."""
    return (FOLDERS[0] if lm_head_bits is None else f"{FOLDERS[0]}{lm_head_bits}", FOLDERS[1])


def prepare(work: Path, cap_gb: float, lm_head_bits: int | None = None) -> dict[str, Any]:
    """The checkpoint, its MTP layer and both exports in `work`, each made only where missing (eagle's run_steps:
    timed, peak RSS, in the memory cap)."""
    python, kvforge = sys.executable, eagle.kvforge_command()
    ckpt = work / CHECKPOINT
    add = ("import json, sys, pathlib; from kvforge.models.mtp_fixture import add_mtp_layers as a; "
           f"n = a(sys.argv[1], seed=0, layers=1, scale={MTP_SCALE}); "
           f"pathlib.Path(sys.argv[1], {MTP_ADDED!r}).write_text(json.dumps(n))")
    export = [*kvforge, "export", str(ckpt), "--target", "ort", "--force", "-o"]
    folders = head_folders(lm_head_bits)
    bits = [] if lm_head_bits is None else ["--draft-lm-head-bits", str(lm_head_bits)]
    steps = [
        ("checkpoint", ckpt / "config.json", [python, str(Path(__file__).resolve()), "--make-checkpoint", str(ckpt)]),
        ("mtp_layer", ckpt / MTP_ADDED, [python, "-c", add, str(ckpt)]),
        (f"export_with_head{'' if lm_head_bits is None else f'_lm{lm_head_bits}'}", work / folders[0] / "kvforge.json", [*export, str(work / folders[0]), *bits]),
        ("export_plain", work / FOLDERS[1] / "kvforge.json", [*export, str(work / FOLDERS[1]), "--no-mtp"]),
    ]
    return eagle.run_steps(work, steps, cap_gb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    eagle.add_timing_arguments(parser, Path("/tmp/mtp-1b"))
    # The timing holds both targets and the head, ~13 GB here (eagle's ~11 GB): the cap it joins is wider
    parser.set_defaults(cap_gb=16.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--make-checkpoint", type=Path, help=argparse.SUPPRESS)  # prepare's first step
    parser.add_argument("--weights-only", action="store_true", help="print the weights shares and stop")
    parser.add_argument("--draft-lm-head-bits", type=int, choices=(4, 8), default=None,
                        help="time the head exported with --draft-lm-head-bits (its own folder, ort-mtp8 / ort-mtp4): "
                             "its lm_head as MatMulNBits instead of the fp32 vocabulary matrix")
    args = parser.parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint)
        return 0
    if args.weights_only:
        print(json.dumps({name: step_elements(c) for name, c in {"1b": SHAPE_1B, **PUBLISHED}.items()}, indent=1))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = args.work.absolute()
    catch_up = [int(s) for s in args.catch_up.split(",") if s]
    made = prepare(work, args.cap_gb, args.draft_lm_head_bits)
    try:  # the timing process joins the cap too (both targets and the head are held)
        (eagle.CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        pass

    report: dict[str, Any] = {
        "issue": 54, "shape": "glm4_moe at Llama-3.2-1B's dimensions", "checkpoint": SHAPE_1B,
        "mtp_layer": {"writer": "models/mtp_fixture.py add_mtp_layers", "layers": 1, "seed": 0, "scale": MTP_SCALE,
                      "template": "layer 15 (MoE)", "head": "full vocabulary (shared_head.head [128256, 2048])",
                      "draft_lm_head_bits": args.draft_lm_head_bits},
        "dtype": "fp32", "target": "ort", **eagle.run_record(args),
        "weights_share": weights_shares(work / CHECKPOINT), "making": made}
    report["modes"] = eagle.time_modes(work, args, catch_up, head_folders(args.draft_lm_head_bits))
    eagle.write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
