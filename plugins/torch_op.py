"""`torch.ops.kvforge.kv_cache_attention`: the custom op HF attention is routed through at export.

Its eager implementation is the reference (plugins/reference.py); the dynamo exporter turns each
call into one canonical node (kvforge.core.contract.CANONICAL_OP) through `custom_translation_table`.
The op's inputs, outputs and attributes are the contract's (ATTENTION_INPUTS, ATTENTION_OUTPUTS,
AttentionAttrs); torch.library and the translation need them spelled out as parameters, which
`check_attention_parameters` holds to the contract's order at import.
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import values as osv

from kvforge.core.contract import (
    ATTENTION_INPUTS,
    ATTENTION_OPTIONAL_INPUTS,
    ATTENTION_OUTPUTS,
    CANONICAL_OP,
    PAST_LENS,
    AttentionAttrs,
    attention_parameters,
    check_attention_parameters,
)
from kvforge.plugins import reference


def _kv_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    attrs = AttentionAttrs(num_heads, kv_num_heads, scale, softcap, sliding_window)
    return reference.kv_cache_attention(q, k, v, past_key, past_value, past_lens, attrs, sinks, alibi_slopes, block_ids,
                                        attention_bias)


check_attention_parameters(_kv_cache_attention, attention_parameters(sinks=True))
kv_cache_attention = torch.library.custom_op("kvforge::kv_cache_attention", mutates_args=())(_kv_cache_attention)


@kv_cache_attention.register_fake
def _(q, k, v, past_key, past_value, *_):
    return torch.empty_like(q), torch.empty_like(past_key), torch.empty_like(past_value)


# ONNX attribute types of the attributes' Python types.
_ONNX_ATTR_TYPES = {int: onnx.defs.OpSchema.AttrType.INT, float: onnx.defs.OpSchema.AttrType.FLOAT}


# Optional inputs whose type is not the activations' (T).
_OPTIONAL_TYPES = {"alibi_slopes": "F", "block_ids": "L"}


def _register_schema() -> None:
    # The translation needs to know the op has three outputs; onnx learns that from a schema.
    if onnx.defs.has(CANONICAL_OP.op_type, CANONICAL_OP.domain):
        return
    param = onnx.defs.OpSchema.FormalParameter
    schema = onnx.defs.OpSchema(
        CANONICAL_OP.op_type,
        CANONICAL_OP.domain,
        CANONICAL_OP.version,
        inputs=[param(name, "I" if name == PAST_LENS else "T") for name in ATTENTION_INPUTS]
        + [param(name, _OPTIONAL_TYPES.get(name, "T"), param_option=onnx.defs.OpSchema.FormalParameterOption.Optional)
           for name in ATTENTION_OPTIONAL_INPUTS],
        outputs=[param(name, "T") for name in ATTENTION_OUTPUTS],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and cache"),
            ("I", ["tensor(int32)"], "cached tokens per row"),
            ("F", ["tensor(float)"], "per-head ALiBi slopes, fp32 whatever the activations' dtype"),
            ("L", ["tensor(int64)"], "per-token image block ids (0: causal)"),
        ],
        attributes=[
            onnx.defs.OpSchema.Attribute(name, _ONNX_ATTR_TYPES[kind], f"kvforge.core.contract.AttentionAttrs.{name}")
            for name, kind in AttentionAttrs.types().items()
        ],
    )
    onnx.defs.register_schema(schema)


_register_schema()
_opset = osv.Opset(CANONICAL_OP.domain, CANONICAL_OP.version)


def onnx_translation(q, k, v, past_key, past_value, past_lens, sinks, alibi_slopes, block_ids, attention_bias,
                     num_heads, kv_num_heads, scale, softcap, sliding_window):
    attrs = AttentionAttrs(num_heads, kv_num_heads, scale, softcap, sliding_window)
    node = getattr(_opset, CANONICAL_OP.op_type)
    optional = [sinks, alibi_slopes, block_ids, attention_bias]
    while optional and optional[-1] is None:  # trailing absent inputs are left off; a middle one stays empty
        optional.pop()
    inputs = [q, k, v, past_key, past_value, past_lens, *optional]
    return node(*inputs, **attrs.as_dict(), _outputs=len(ATTENTION_OUTPUTS))


check_attention_parameters(onnx_translation, attention_parameters(sinks=True))

CUSTOM_TRANSLATION_TABLE = {torch.ops.kvforge.kv_cache_attention.default: onnx_translation}
