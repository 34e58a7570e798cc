"""`torch.ops.kvforge.moe_experts`: the custom op HF experts are routed through at export, beside the attention op
(plugins/torch_op.py). Each token's top-k experts, SwiGLU, weighted sum.

HF's MoE blocks keep their router (logits -> top-k -> normalisation, which differs by family: softmax
or sigmoid, renormalised or not, grouped, biased) as plain graph ops; only the experts go through this op
(exporter/experts_routing.py routes them). The dynamo exporter turns each call into one canonical node
(kvforge.core.contract.MOE_OP) through `CUSTOM_TRANSLATION_TABLE`:

  inputs  hidden [N, H], top_k_index [N, k] int64, top_k_weights [N, k],
          gate_up [E, 2I, H] (gate and up rows interleaved: gate_j at row 2j, up_j at 2j + 1),
          down [E, H, I], optional gate_up_bias [E, 2I] and down_bias [E, H]
  attrs   activation_alpha, activation_beta, swiglu_limit (0: none)
  output  sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(hidden[n])
          expert_e(x) = down[e] @ act(gate_up[e] @ x + gate_up_bias[e]) + down_bias[e]
          act(z) = g * sigmoid(alpha * g) * (u + beta), g = min(z_gate, limit), u = clip(z_up, -limit, limit)

(alpha 1, beta 0, no limit is SiLU gating: Qwen-MoE, Mixtral, OLMoE, ...; gpt-oss uses 1.702, 1, 7.)
Lowerings (exporter/targets/): `ort` -> com.microsoft.MoE (ONNX Runtime's fused experts, CPU and CUDA;
moe_ort.py); `onnx` and `trt` -> plain ONNX that gathers the picked experts' weights and runs only those
(moe_plain.py).
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import values as osv

from kvforge.core.contract import MOE_OP


def activation(z: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
    """The node's act(z) on the interleaved layout (gate rows even, up rows odd)."""
    gate, up = z[..., 0::2], z[..., 1::2]
    if limit > 0.0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + beta)


def _moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None, activation_alpha: float, activation_beta: float,
                 swiglu_limit: float) -> torch.Tensor:
    """The node's semantics (the reference every lowering is checked against)."""
    tokens, k = top_k_index.shape
    picked = top_k_index.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0)  # [N*k, H]
    z = torch.bmm(gate_up[picked], x.unsqueeze(-1)).squeeze(-1)
    if gate_up_bias is not None:
        z = z + gate_up_bias[picked]
    y = torch.bmm(down[picked], activation(z, activation_alpha, activation_beta, swiglu_limit).unsqueeze(-1)).squeeze(-1)
    if down_bias is not None:
        y = y + down_bias[picked]
    weighted = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return weighted.reshape(tokens, k, -1).sum(dim=1).to(hidden.dtype)


moe_experts = torch.library.custom_op("kvforge::moe_experts", mutates_args=())(_moe_experts)


@moe_experts.register_fake
def _(hidden, *_):
    return torch.empty_like(hidden)


def _register_schema() -> None:
    # The translation builds the node through an onnxscript opset, which needs the op's schema.
    if onnx.defs.has(MOE_OP.op_type, MOE_OP.domain):
        return
    param = onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    floats = onnx.defs.OpSchema.AttrType.FLOAT
    onnx.defs.register_schema(onnx.defs.OpSchema(
        MOE_OP.op_type, MOE_OP.domain, MOE_OP.version,
        inputs=[param("hidden", "T"), param("top_k_index", "I"), param("top_k_weights", "T"), param("gate_up", "T"),
                param("down", "T"), param("gate_up_bias", "T", param_option=optional),
                param("down_bias", "T", param_option=optional)],
        outputs=[param("out", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations, weights"),
                          ("I", ["tensor(int64)"], "expert ids")],
        attributes=[onnx.defs.OpSchema.Attribute(name, floats, "see kvforge/plugins/moe_op.py")
                    for name in ("activation_alpha", "activation_beta", "swiglu_limit")],
    ))


_register_schema()
_opset = osv.Opset(MOE_OP.domain, MOE_OP.version)


def _translation(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation_alpha,
                 activation_beta, swiglu_limit):
    inputs = [hidden, top_k_index, top_k_weights, gate_up, down]
    if gate_up_bias is not None:
        inputs += [gate_up_bias, down_bias]
    return getattr(_opset, MOE_OP.op_type)(*inputs, activation_alpha=activation_alpha,
                                           activation_beta=activation_beta, swiglu_limit=swiglu_limit)


CUSTOM_TRANSLATION_TABLE = {torch.ops.kvforge.moe_experts.default: _translation}
