"""The canonical mixture-of-experts node: each token's top-k experts, SwiGLU, weighted sum.

HF's MoE blocks keep their router (logits -> top-k -> normalisation, which differs by family: softmax
or sigmoid, renormalised or not, grouped, biased) as plain graph ops; only the experts go through
`torch.ops.kvforge.moe_experts`, registered as transformers' "kvforge" experts implementation. The
dynamo exporter turns each call into one node (kvforge.core.contract.MOE_OP):

  inputs  hidden [N, H], top_k_index [N, k] int64, top_k_weights [N, k],
          gate_up [E, 2I, H] (gate and up rows interleaved: gate_j at row 2j, up_j at 2j + 1),
          down [E, H, I], optional gate_up_bias [E, 2I] and down_bias [E, H]
  attrs   activation_alpha, activation_beta, swiglu_limit (0: none)
  output  sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(hidden[n])
          expert_e(x) = down[e] @ act(gate_up[e] @ x + gate_up_bias[e]) + down_bias[e]
          act(z) = g * sigmoid(alpha * g) * (u + beta), g = min(z_gate, limit), u = clip(z_up, -limit, limit)

(alpha 1, beta 0, no limit is SiLU gating: Qwen-MoE, Mixtral, OLMoE, ...; gpt-oss uses 1.702, 1, 7.)
Lowerings: `ort` -> com.microsoft.MoE (ONNX Runtime's fused experts, CPU and CUDA); `onnx` and `trt`
-> plain ONNX that gathers the picked experts' weights and runs only those. Experts whose gate is not
of this form keep transformers' `batched_mm` implementation (the same gather form, traced).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnxscript import values as osv
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

from kvforge.core.contract import MOE_OP
from kvforge.core.errors import ExportError
from kvforge.exporter.graph_edit import constant as _const
from kvforge.exporter.graph_edit import replace_node as _replace

EXPERTS_IMPLEMENTATION = "kvforge"
_CANONICAL = "_kvforge_moe"  # the attribute a prepared experts module holds its MoEAttrs in


def _act(z: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
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
    y = torch.bmm(down[picked], _act(z, activation_alpha, activation_beta, swiglu_limit).unsqueeze(-1)).squeeze(-1)
    if down_bias is not None:
        y = y + down_bias[picked]
    weighted = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return weighted.reshape(tokens, k, -1).sum(dim=1).to(hidden.dtype)


moe_experts = torch.library.custom_op("kvforge::moe_experts", mutates_args=())(_moe_experts)


@moe_experts.register_fake
def _(hidden, *_):
    return torch.empty_like(hidden)


def _register_schema() -> None:
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
        attributes=[onnx.defs.OpSchema.Attribute(name, floats, "see kvforge/exporter/moe.py")
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


# -- routing HF's experts modules through the node ---------------------------------------------------
def _kvforge_experts(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    attrs = getattr(module, _CANONICAL, None)
    if attrs is None:  # a gate the node does not model: the traced gather form
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    biases = (module.kvforge_gate_up_bias, module.kvforge_down_bias) if module.has_bias else (None, None)
    return torch.ops.kvforge.moe_experts(hidden_states, top_k_index.to(torch.int64), top_k_weights,
                                         module.kvforge_gate_up, module.kvforge_down, *biases, *attrs)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _kvforge_experts)


def _gate_form(module: torch.nn.Module, width: int) -> tuple[float, float, float] | None:
    """(alpha, beta, limit) such that the module's own gate equals the node's activation on the
    interleaved layout, checked on random inputs; None if no such form matches."""
    candidates = [(1.0, 0.0, 0.0)]
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, float) and isinstance(limit, (int, float)):
        candidates.append((alpha, 1.0, float(limit)))  # gpt-oss: clamped, (up + 1)
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(16, 2 * width, generator=generator) * 4.0
    with torch.no_grad():
        theirs = module._apply_gate(probe)
        # Their layout -> the node's interleaved one.
        ours = probe if not module.is_concatenated else torch.stack(probe.chunk(2, dim=-1), dim=-1).flatten(-2)
        for form in candidates:
            if torch.allclose(_act(ours, *form), theirs, atol=1e-5, rtol=1e-5):
                return form
    return None


def set_experts_implementation(model: torch.nn.Module, implementation: str, patches: Any) -> None:
    """The model's experts implementation, set back to the one it had when `patches` closes."""
    previous = model.config._experts_implementation
    model.set_experts_implementation(implementation)
    patches.callback(model.set_experts_implementation, previous)


def prepare_experts(model: torch.nn.Module, patches: Any) -> dict[str, int]:
    """Route the model's experts modules through the canonical node where their gate is SwiGLU-like:
    each gets its weights in the node's layout (buffers, so the graph reads them as initializers) and
    the model's experts implementation becomes "kvforge", all on the export's `patches`. Returns how many
    modules went each way."""
    counts = {"node": 0, "batched_mm": 0}
    for module in model.modules():
        if not hasattr(module, "has_gate") or not hasattr(module, "down_proj"):
            continue
        form = None
        if module.has_gate and not module.has_post_expert_norm:
            gate_up = module.gate_up_proj.detach()
            if module.is_transposed:  # [E, H, 2I] -> [E, 2I, H]
                gate_up = gate_up.transpose(1, 2)
            form = _gate_form(module, gate_up.shape[1] // 2)
        if form is None:
            counts["batched_mm"] += 1
            continue
        down = module.down_proj.detach()
        down = down.transpose(1, 2) if module.is_transposed else down
        bias = module.gate_up_proj_bias.detach() if module.has_bias else None
        if module.is_concatenated:  # [gate; up] -> gate_0, up_0, gate_1, up_1, ...
            gate_up = torch.stack(gate_up.chunk(2, dim=1), dim=2).flatten(1, 2)
            bias = torch.stack(bias.chunk(2, dim=1), dim=2).flatten(1, 2) if bias is not None else None
        patches.buffer(module, "kvforge_gate_up", gate_up.contiguous())
        patches.buffer(module, "kvforge_down", down.contiguous())
        if bias is not None:
            patches.buffer(module, "kvforge_gate_up_bias", bias.contiguous())
            patches.buffer(module, "kvforge_down_bias", module.down_proj_bias.detach().contiguous())
        patches.set(module, _CANONICAL, form)
        # The module now reads only the node's copies: drop its own, so an export holds its experts once.
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if name in module._parameters:
                patches.delete_parameter(module, name)
        counts["node"] += 1
    if counts["node"]:
        set_experts_implementation(model, EXPERTS_IMPLEMENTATION, patches)
    return counts


# -- experts modules that loop over the experts a batch hits -----------------------------------------
# Some families write their experts as a Python loop over the experts the batch picked (a data-dependent
# loop torch.export cannot trace) and keep their weights in their own layout. Their family's
# `looped_experts` reads a module's weights into the node's layout (models/families/family.py's
# LoopedExperts); the module then runs the node over its routed experts, and identity experts (LongCat-
# Flash's zero-computation experts: ids from E on, output = input) add their weight times the input.
def _looped_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    hidden = hidden_states.reshape(-1, module.kvforge_gate_up.shape[-1])
    index = top_k_index.to(torch.int64)
    routed = module.kvforge_gate_up.shape[0]
    out = None
    if module.kvforge_identity_experts:
        is_routed = index < routed
        # An identity expert's pick runs expert 0 at weight 0 in the node and adds weight x input here.
        identity_weight = torch.where(is_routed, torch.zeros_like(top_k_weights), top_k_weights).sum(-1, keepdim=True)
        out = hidden * identity_weight.to(hidden.dtype)
        index = torch.where(is_routed, index, torch.zeros_like(index))
        top_k_weights = torch.where(is_routed, top_k_weights, torch.zeros_like(top_k_weights))
    y = torch.ops.kvforge.moe_experts(hidden, index, top_k_weights, module.kvforge_gate_up, module.kvforge_down,
                                      None, None, 1.0, 0.0, 0.0)
    y = y if out is None else y + out
    # DBRX returns [batch, -1, H] from [batch, ..., H]; LongCat the shape it was given.
    return y.view(hidden_states.shape[0], -1, y.shape[-1]) if module.kvforge_batch_first else y.view_as(hidden_states)


def _is_silu(act: Any) -> bool:
    probe = torch.linspace(-8.0, 8.0, 101)
    with torch.no_grad():
        return bool(torch.allclose(act(probe), torch.nn.functional.silu(probe), atol=1e-6))


def looped_experts_count(model: torch.nn.Module, family: Any) -> int:
    """How many experts modules prepare_looped_experts would route (it rebuilds their weights from values)."""
    if family.looped_experts is None:
        return 0
    return sum(family.looped_experts(module) is not None for module in model.modules())


def prepare_looped_experts(model: torch.nn.Module, family: Any, patches: Any) -> int:
    """Route experts modules written as a loop over the experts a batch hits (the family's `looped_experts`) through
    the canonical node, where their gate is SiLU: their forward becomes the node over the routed experts (plus
    the identity experts' weighted input), on the export's `patches`. Returns how many modules were routed."""
    count = 0
    for module in list(model.modules()) if family.looped_experts is not None else ():
        read = family.looped_experts(module)
        if read is None or getattr(module, _CANONICAL, None) is not None:
            continue
        if not _is_silu(read.activation):
            continue  # the node models SiLU gating only; the module stays as written (and fails to trace)
        # Interleaved: gate_0, up_0, gate_1, ...
        patches.buffer(module, "kvforge_gate_up", torch.stack((read.gate, read.up), dim=2).flatten(1, 2).contiguous())
        patches.buffer(module, "kvforge_down", read.down.contiguous())
        patches.set(module, "kvforge_identity_experts", read.identity)
        patches.set(module, "kvforge_batch_first", read.batch_first)
        patches.set(module, _CANONICAL, (1.0, 0.0, 0.0))
        patches.set(module, "forward", _looped_forward.__get__(module))
        for owner, name in read.parameters:  # the module's own copies: an export holds its experts once
            if name in owner._parameters:
                patches.delete_parameter(owner, name)
        count += 1
    return count


# -- lowerings ---------------------------------------------------------------------------------------
def moe_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [node for node in graph if node.domain == MOE_OP.domain and node.op_type == MOE_OP.op_type]


def _parts(node: ir.Node) -> tuple[list[ir.Value], ir.Value | None, ir.Value | None, tuple[float, float, float]]:
    inputs = list(node.inputs)
    biases = (inputs[5], inputs[6]) if len(inputs) > 5 else (None, None)
    attrs = tuple(float(node.attributes[name].value) for name in ("activation_alpha", "activation_beta",
                                                                     "swiglu_limit"))
    return inputs[:5], biases[0], biases[1], attrs


# Measured with onnxruntime 1.32 (tests/test_moe_node.py): its CPU QMoE computes 4-bit block-wise experts
# exactly as dequantised, but 8-bit block-wise ones 0.25 off at outputs of ~20; 8-bit per-row ones agree,
# and ONNX Runtime's quantiser makes those only for input sizes of at most 256.
INT8_EXPERTS = ("the experts stay fp32 with --quantize int8: ONNX Runtime's CPU QMoE disagrees with its own 8-bit "
                "block-wise weights")


def quantize_experts(weights: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, out, in] float -> (packed uint8 [E, out, in * bits / 8], scales [E, out, in / block_size]):
    block-wise symmetric, each expert by ONNX Runtime's own MatMulNBits quantiser (whose packed
    [out, blocks, block bytes] layout is QMoE's [out, in * bits / 8] when `in` is a multiple of the block)."""
    from onnxruntime.capi import _pybind_state

    quantize = {4: _pybind_state.quantize_matmul_4bits, 8: _pybind_state.quantize_matmul_8bits}[bits]
    experts, rows, cols = weights.shape
    blocks = cols // block_size
    packed = np.zeros((experts, rows, blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros((experts, rows * blocks), np.float32)
    zero_points = np.zeros(rows * blocks, np.uint8)  # unused: symmetric
    for expert in range(experts):
        # The quantiser takes a MatMul's B, [in, out].
        quantize(packed[expert], np.ascontiguousarray(weights[expert].T, np.float32), scales[expert], zero_points,
                 block_size, rows, cols, True)
    return packed.reshape(experts, rows, -1), scales.reshape(experts, rows, blocks)


# The prefill and decode graphs share their weight tensors (derive_decode_graph clones the graph, not the
# weights), so an experts tensor is quantised once per export rather than once per graph.
_QUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _quantized_initializer(graph: ir.Graph, value: ir.Value, bits: int, block_size: int) -> tuple[ir.Value, ir.Value]:
    done = _QUANTIZED.setdefault(value.const_value, {})
    if (bits, block_size) not in done:
        done[bits, block_size] = quantize_experts(value.const_value.numpy(), bits, block_size)
    packed, scales = done[bits, block_size]
    made = []
    for suffix, array in (("q", packed), ("scales", scales)):
        name = f"{value.name}_{suffix}{bits}"
        if name not in graph.initializers:
            graph.register_initializer(ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(
                ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name)))
        made.append(graph.initializers[name])
    return made[0], made[1]


def lower_moe_to_ort(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    """com.microsoft.MoE per node (com.microsoft.QMoE with `quantize` = (4, block_size): the experts'
    weights int4, block-wise symmetric; see INT8_EXPERTS for int8). The op routes by itself (softmax over router logits,
    top-k), so it is handed logits whose softmax is HF's own top-k weights over their sum: log(w) at the
    picked experts, -inf elsewhere; the result is scaled back by that sum (the experts are linear in
    their weights)."""
    if quantize is not None and quantize[0] != 4:
        raise ExportError(INT8_EXPERTS)
    nodes = moe_nodes(graph)
    for node in nodes:
        (hidden, index, weights, gate_up, down), gate_up_bias, down_bias, (alpha, beta, limit) = _parts(node)
        experts, k = gate_up.shape[0] if gate_up.shape else None, index.shape[1] if index.shape else None
        if not isinstance(experts, int) or not isinstance(k, int):
            raise ExportError(f"MoE node {node.name}: the expert count and top-k must be static for ONNX Runtime's MoE")
        dtype = weights.dtype.numpy() if weights.dtype is not None else np.float32
        tape = ir.tape.Tape()
        rows = tape.op("Shape", [index], attributes={"start": 0, "end": 1})
        shape = tape.op("Concat", [rows, _const(tape, np.array([experts], np.int64))], attributes={"axis": 0})
        blocked = tape.op("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.array([-np.inf], dtype))})
        # A pick of weight 0 (an identity expert's pick, see _looped_forward, run as a routed expert at weight 0)
        # is floored to the dtype's tiny, so that a token whose picks are all weight 0 does not softmax -inf alone
        # (NaN); where it repeats another pick of that token's, "max" keeps the real one.
        floored = tape.op("Max", [weights, _const(tape, np.array(np.finfo(dtype).tiny, dtype))])
        logits = tape.op("ScatterElements", [blocked, index, tape.op("Log", [floored])],
                         attributes={"axis": 1, "reduction": "max"})
        total = tape.op("ReduceSum", [weights, _const(tape, np.array([1], np.int64))], attributes={"keepdims": 1})
        if hidden.dtype is not None and weights.dtype not in (None, hidden.dtype):
            # Mixtral's router hands on its weights in fp32 beside fp16 / bf16 hidden states; ONNX Runtime's MoE
            # takes one type for both (the routing above stays in the weights' precision).
            logits = tape.op("Cast", [logits], attributes={"to": hidden.dtype.value})
            total = tape.op("Cast", [total], attributes={"to": hidden.dtype.value})
        attributes: dict[str, Any] = {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1,
                                      "activation_alpha": alpha, "activation_beta": beta,
                                      "normalize_routing_weights": 0}
        if limit > 0.0:
            attributes["swiglu_limit"] = limit
        if quantize is not None:
            bits, block_size = quantize
            if gate_up.const_value is None or down.const_value is None:
                raise ExportError(f"MoE node {node.name}: the experts' weights are not constants; cannot quantise them")
            if gate_up.shape[2] % block_size or down.shape[2] % block_size:
                raise ExportError(f"MoE node {node.name}: the experts' input sizes ({gate_up.shape[2]}, "
                                  f"{down.shape[2]}) are not multiples of --block-size {block_size}")
            fc1, fc1_scales = _quantized_initializer(graph, gate_up, bits, block_size)
            fc2, fc2_scales = _quantized_initializer(graph, down, bits, block_size)
            attributes.update(expert_weight_bits=bits, block_size=block_size)
            fused = tape.op("QMoE", [hidden, logits, fc1, fc1_scales, gate_up_bias, fc2, fc2_scales, down_bias],
                            attributes=attributes, domain="com.microsoft")
        else:
            fused = tape.op("MoE", [hidden, logits, gate_up, gate_up_bias, down, down_bias], attributes=attributes,
                            domain="com.microsoft")
        _replace(graph, node, tape, [tape.op("Mul", [fused, total])])
    if nodes:
        graph.opset_imports["com.microsoft"] = 1
    return len(nodes)


def lower_moe_to_plain(graph: ir.Graph, quantize: tuple[int, int] | None = None) -> int:
    """Standard ONNX: gather each token's k experts' weights, two batched MatMuls, the activation, the
    weighted sum. Only the picked experts run (each token copies k weight matrices)."""
    nodes = moe_nodes(graph)
    for node in nodes:
        (hidden, index, weights, gate_up, down), gate_up_bias, down_bias, (alpha, beta, limit) = _parts(node)
        dtype = weights.dtype.numpy() if weights.dtype is not None else np.float32
        tape = ir.tape.Tape()
        x = tape.op("Unsqueeze", [hidden, _const(tape, np.array([1, 3], np.int64))])  # [N, 1, H, 1]
        z = tape.op("MatMul", [tape.op("Gather", [gate_up, index]), x])  # [N, k, 2I, 1]
        z = tape.op("Squeeze", [z, _const(tape, np.array([3], np.int64))])
        if gate_up_bias is not None:
            z = tape.op("Add", [z, tape.op("Gather", [gate_up_bias, index])])

        gate, up = (tape.op("Slice", [z, _const(tape, np.array([start], np.int64)),
                                      _const(tape, np.array([np.iinfo(np.int64).max], np.int64)),
                                      _const(tape, np.array([2], np.int64)), _const(tape, np.array([2], np.int64))])
                    for start in (0, 1))  # the interleaved gate and up rows
        if limit > 0.0:
            gate = tape.op("Min", [gate, _const(tape, np.array(limit, dtype))])
            up = tape.op("Clip", [up, _const(tape, np.array(-limit, dtype)), _const(tape, np.array(limit, dtype))])
        scaled = tape.op("Mul", [gate, _const(tape, np.array(alpha, dtype))]) if alpha != 1.0 else gate
        act = tape.op("Mul", [tape.op("Mul", [gate, tape.op("Sigmoid", [scaled])]),
                              tape.op("Add", [up, _const(tape, np.array(beta, dtype))]) if beta != 0.0 else up])
        act = tape.op("Unsqueeze", [act, _const(tape, np.array([3], np.int64))])  # [N, k, I, 1]
        y = tape.op("Squeeze", [tape.op("MatMul", [tape.op("Gather", [down, index]), act]),
                                _const(tape, np.array([3], np.int64))])  # [N, k, H]
        if down_bias is not None:
            y = tape.op("Add", [y, tape.op("Gather", [down_bias, index])])
        weighted = tape.op("Mul", [y, tape.op("Unsqueeze", [weights, _const(tape, np.array([2], np.int64))])])
        out = tape.op("ReduceSum", [weighted, _const(tape, np.array([1], np.int64))], attributes={"keepdims": 0})
        _replace(graph, node, tape, [out])
    return len(nodes)
