"""`torch.ops.kvforge.cross_attention`: the op an encoder-decoder's cross attention (and its encoder's own attention)
is routed through at export (kvforge/core/encoder_contract.py defines it).

Its eager implementation is the reference; the dynamo exporter turns each call into one canonical node
(encoder_contract.CROSS_OP) through `CUSTOM_TRANSLATION_TABLE`, which the target lowerings then rewrite
(exporter/targets/cross_attention.py).
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import values as osv

from kvforge.core.encoder_contract import (
    CROSS_ATTRIBUTES,
    CROSS_INPUTS,
    CROSS_OP,
    CROSS_OPTIONAL_INPUTS,
    CROSS_OUTPUTS,
)


def reference(q: torch.Tensor, cross_key: torch.Tensor, cross_value: torch.Tensor, encoder_lens: torch.Tensor,
              attention_bias: torch.Tensor | None, num_heads: int, scale: float) -> torch.Tensor:
    """Attention of q [B, S, H*D] over the first encoder_lens[b] keys of K/V [B, H, T, D], `attention_bias`
    [B|1, H, S, T] (or None) added to the scores; no causal mask. Scores in fp32; a row with no keys (length 0) gives
    zeros."""
    batch, seq, _ = q.shape
    head_dim = cross_key.shape[-1]
    query = q.view(batch, seq, num_heads, head_dim).transpose(1, 2).float()
    scores = torch.matmul(query, cross_key.float().transpose(-1, -2)) * scale  # [B, H, S, T]
    if attention_bias is not None:
        scores = scores + attention_bias.float()
    keep = torch.arange(cross_key.shape[2], device=q.device)[None, :] < encoder_lens.to(torch.int64)[:, None]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.matmul(weights, cross_value.float())  # [B, H, S, D]
    return out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim).to(q.dtype)


cross_attention = torch.library.custom_op("kvforge::cross_attention", mutates_args=())(reference)


@cross_attention.register_fake
def _(q, cross_key, cross_value, encoder_lens, attention_bias, num_heads, scale):
    return torch.empty_like(q)


_ONNX_ATTR_TYPES = {int: onnx.defs.OpSchema.AttrType.INT, float: onnx.defs.OpSchema.AttrType.FLOAT}


def _register_schema() -> None:
    # The translation needs to know the op's outputs; onnx learns them from a schema.
    if onnx.defs.has(CROSS_OP.op_type, CROSS_OP.domain):
        return
    param = onnx.defs.OpSchema.FormalParameter
    schema = onnx.defs.OpSchema(
        CROSS_OP.op_type, CROSS_OP.domain, CROSS_OP.version,
        inputs=[param(name, "I" if name == "encoder_lens" else "T") for name in CROSS_INPUTS]
        + [param(name, "T", param_option=onnx.defs.OpSchema.FormalParameterOption.Optional)
           for name in CROSS_OPTIONAL_INPUTS],
        outputs=[param(name, "T") for name in CROSS_OUTPUTS],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
                          ("I", ["tensor(int32)"], "encoder length per row")],
        attributes=[onnx.defs.OpSchema.Attribute(name, _ONNX_ATTR_TYPES[kind], f"encoder_contract.{name}")
                    for name, kind in CROSS_ATTRIBUTES.items()],
    )
    onnx.defs.register_schema(schema)


_register_schema()
_opset = osv.Opset(CROSS_OP.domain, CROSS_OP.version)


def onnx_translation(q, cross_key, cross_value, encoder_lens, attention_bias, num_heads, scale):
    inputs = [q, cross_key, cross_value, encoder_lens] + ([attention_bias] if attention_bias is not None else [])
    return getattr(_opset, CROSS_OP.op_type)(*inputs, num_heads=num_heads, scale=scale)


CUSTOM_TRANSLATION_TABLE = {torch.ops.kvforge.cross_attention.default: onnx_translation}
