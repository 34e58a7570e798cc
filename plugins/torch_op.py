"""`torch.ops.kvforge.kv_cache_attention`: the custom op HF attention is routed through at export.

Its eager implementation is the reference (plugins/reference.py); the dynamo exporter turns each
call into one `kvforge::KVCacheAttention` node through `custom_translation_table`.
"""

from __future__ import annotations

import onnx
import torch
from onnxscript import values as osv

from kvforge.plugins import reference

DOMAIN = "kvforge"
OP_TYPE = "KVCacheAttention"
INPUTS = ("q", "k", "v", "past_key", "past_value", "past_lens")
OUTPUTS = ("out", "present_key", "present_value")
ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "softcap", "sliding_window")


@torch.library.custom_op("kvforge::kv_cache_attention", mutates_args=())
def kv_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_lens: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.kv_cache_attention(
        q, k, v, past_key, past_value, past_lens, num_heads, kv_num_heads, scale, softcap, sliding_window
    )


@kv_cache_attention.register_fake
def _(q, k, v, past_key, past_value, past_lens, num_heads, kv_num_heads, scale, softcap, sliding_window):
    return torch.empty_like(q), torch.empty_like(past_key), torch.empty_like(past_value)


def _register_schema() -> None:
    # The translation needs to know the op has three outputs; onnx learns that from a schema.
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    attr = onnx.defs.OpSchema.Attribute
    types = onnx.defs.OpSchema.AttrType
    schema = onnx.defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        1,
        inputs=[onnx.defs.OpSchema.FormalParameter(name, "T" if name != "past_lens" else "I") for name in INPUTS],
        outputs=[onnx.defs.OpSchema.FormalParameter(name, "T") for name in OUTPUTS],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and cache"),
            ("I", ["tensor(int32)"], "cached tokens per row"),
        ],
        attributes=[
            attr("num_heads", types.INT, "query heads"),
            attr("kv_num_heads", types.INT, "key/value heads"),
            attr("scale", types.FLOAT, "softmax scale"),
            attr("softcap", types.FLOAT, "logit softcap, 0 = off"),
            attr("sliding_window", types.INT, "attend only the last W positions, 0 = off"),
        ],
    )
    onnx.defs.register_schema(schema)


_register_schema()
_opset = osv.Opset(DOMAIN, 1)


def onnx_translation(q, k, v, past_key, past_value, past_lens, num_heads, kv_num_heads, scale, softcap, sliding_window):
    return _opset.KVCacheAttention(
        q, k, v, past_key, past_value, past_lens,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, softcap=softcap,
        sliding_window=sliding_window, _outputs=3,
    )


CUSTOM_TRANSLATION_TABLE = {torch.ops.kvforge.kv_cache_attention.default: onnx_translation}
