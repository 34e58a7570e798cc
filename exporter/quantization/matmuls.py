"""Weight-only int4 / int8 quantisation with ONNX Runtime's own MatMulNBits quantiser.

Every MatMul with a constant weight becomes com.microsoft.MatMulNBits (block-wise, symmetric), the
lm_head included; the token embedding becomes com.microsoft.GatherBlockQuantized, so a tied embedding
is not kept in fp32 either. Nothing here computes quantised values itself: that is
`onnxruntime.quantization.matmul_nbits_quantizer`. kvforge only prepares the graph (a weight reached
through a Transpose is materialised, so the quantiser sees a constant) and records what was done.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401  (ir.passes.common below)

from kvforge.core.errors import ExportError
from kvforge.core.progress import quiet_logger
from kvforge.exporter.graph_edit import take_over
from kvforge.exporter.quantization.choices import BITS, DEFAULT_ACCURACY_LEVEL
from kvforge.exporter.quantization.exact_blocks import IntWeightSource, import_matmul, source_names, specs_for
from kvforge.exporter.quantization.float_offsets import move_float_zero_points
from kvforge.exporter.quantization.rtn import quantizer_class


def _materialise_transposed_weights(model: ir.Model) -> dict[str, str]:
    """MatMul(x, Transpose(W)) with W constant (a tied lm_head) -> MatMul(x, W^T as a constant, lazy).
    Returns {the new constant's name: W's name}."""
    from kvforge.exporter.lazy_weights import transposed

    made = {}
    for node in list(model.graph):
        if node.op_type != "MatMul" or node.domain != "":
            continue
        transpose = node.inputs[1].producer() if node.inputs[1] is not None else None
        if transpose is None or transpose.op_type != "Transpose":
            continue
        source = transpose.inputs[0]
        if source is None or source.const_value is None:
            continue
        perm = transpose.attributes.get("perm")
        name = f"{source.name}_transposed"
        table = transposed(source.const_value, None if perm is None else list(perm.value), name)
        value = ir.Value(name=name, shape=ir.Shape(list(table.shape)), type=source.type, const_value=table)
        model.graph.register_initializer(value)
        node.replace_input_with(1, value)
        made[name] = source.name
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return made


def share_tied_embedding(model: ir.Model, tied: dict[str, str]) -> int:
    """A tied embedding looked up in its lm_head's quantised table (`tied`: the lm_head's transposed
    weight name -> the embedding's), whose Gather quantize_model kept away from the quantiser (which
    would make int4 its own 4-bit copy and leave int8's fp32). GatherBlockQuantized reads MatMulNBits'
    blocks as they are ([N, blocks, bytes] viewed as [N, blocks * bytes], its default zero point being
    MatMulNBits'), so the weights hold the table once: for int4 the same values the copy had; int8 (and
    int4 with an 8-bit lm_head) look up 8-bit values. Returns how many were shared. A lookup it cannot
    share stays a fp32 Gather."""
    graph, shared = model.graph, 0
    lookups = [n for n in graph if n.op_type == "Gather" and n.inputs[0] is not None]
    for head in list(graph):
        if head.op_type != "MatMulNBits" or len(head.inputs) > 3 and any(v is not None for v in head.inputs[3:]):
            continue  # zero points, group index or bias: not the symmetric layout the lookup assumes
        weight, scales = head.inputs[1], head.inputs[2]
        source = next((tied[name] for name in tied if weight.name.startswith(f"{name}_Q")), None)
        if source is None or weight.const_value is None or len(weight.shape) != 3:
            continue
        lookup = next((n for n in lookups if n.inputs[0].name == source), None)
        if lookup is None or lookup.attributes.get_int("axis", 0) != 0:
            continue
        rows, blocks, width = weight.shape
        tape = ir.tape.Tape()
        view = tape.op("Reshape", [weight, tape.initializer(ir.tensor(np.array([rows, blocks * width], np.int64)),
                                                                      name=f"{weight.name}_rows")])
        if len(scales.shape) != 2:
            scales = tape.op("Reshape", [scales, tape.initializer(ir.tensor(np.array([rows, blocks], np.int64)),
                                                                            name=f"{scales.name}_rows")])
        attrs = {"bits": head.attributes.get_int("bits"), "block_size": head.attributes.get_int("block_size"),
                 "gather_axis": 0, "quantize_axis": 1}
        gathered = tape.op("GatherBlockQuantized", [view, lookup.inputs[1], scales], attributes=attrs,
                           domain="com.microsoft")
        for value in tape.initializers:
            graph.register_initializer(value)
        graph.insert_before(lookup, tape.nodes)
        take_over(graph, lookup, gathered)
        shared += 1
    if shared:
        ir.passes.common.RemoveUnusedNodesPass()(model)  # and the copy / fp32 table the lookup read
    return shared


def _vocab_nodes(model: ir.Model, vocab_size: int) -> dict[str, str]:
    """The lm_head MatMul and the embedding Gather (name -> op type): the nodes whose constant
    weight has a vocabulary-sized dimension."""
    names = {}
    for node in model.graph:
        if node.op_type in ("MatMul", "Gather") and node.domain == "":
            weight = node.inputs[1] if node.op_type == "MatMul" else node.inputs[0]
            if weight is not None and weight.const_value is not None and vocab_size in weight.const_value.shape:
                names[node.name] = node.op_type
    return names


def _hqq_config(bits: int, block_size: int) -> Any:
    quantizer_class()  # the module imported without its logging side effect
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig

    return HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits, op_types_to_quantize=("MatMul",),
                                    quant_axes=(("MatMul", 0),))


def _run_quantizer(proto: Any, bits: int, block_size: int, accuracy_level: int, method: str = "rtn",
                   say: Callable[[str], None] | None = None, **nodes: Any) -> Any:
    if method == "hqq":
        return _run_hqq(proto, bits, block_size, accuracy_level, say or (lambda _line: None), **nodes)
    quantizer = quantizer_class()(
        proto, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
        # Its Gather quantisation is 4-bit only (at 8 bits it logs an error and leaves the Gather);
        # an 8-bit tied embedding is looked up in the lm_head's table instead (share_tied_embedding).
        op_types_to_quantize=("MatMul", "Gather") if bits == 4 else ("MatMul",),
        quant_axes=(("MatMul", 0), ("Gather", 1)), **nodes,
    )
    # A block of zeros has scale 0: the quantiser divides by it inside np.where(scale == 0, 0, ...), which
    # picks 0 there, yet numpy still warns about the division it discarded.
    with np.errstate(divide="ignore", invalid="ignore"):
        quantizer.process()
    return quantizer.model.model


# HQQ's torch work: many small tensor operations a matrix, where extra threads only wait on each other; on a
# busy CPU they made it 6-12x slower (SmolLM2-135M: 110-213 s on 2 threads, 18 s on one; the same bytes).
HQQ_THREADS = 1
PROGRESS_S = 5.0  # seconds between HQQ's "matrix k of n" lines


def _run_hqq(proto: Any, bits: int, block_size: int, accuracy_level: int, say: Callable[[str], None],
             **nodes: Any) -> Any:
    """ONNX Runtime's HQQ over the proto's MatMuls on HQQ_THREADS torch threads (restored after), saying
    "matrix k of n" as it goes."""
    import torch

    quantizer = quantizer_class()(proto, bits=bits, block_size=block_size, algo_config=_hqq_config(bits, block_size),
                                  **nodes)
    excluded = set(nodes.get("nodes_to_exclude") or ())
    constants = {t.name for t in proto.graph.initializer}
    total = sum(1 for n in proto.graph.node if n.op_type == "MatMul" and n.name not in excluded
                and len(n.input) > 1 and n.input[1] in constants)
    one_matrix, done, began = quantizer.node_quantizer.quantize, [0, 0.0], time.perf_counter()

    def counted(node: Any, graph_stack: Any) -> Any:
        result = one_matrix(node, graph_stack)
        done[0] += 1
        now = time.perf_counter()
        if done[0] == 1 or now - done[1] >= PROGRESS_S or done[0] == total:
            left = (now - began) / done[0] * (total - done[0])
            say(f"HQQ: matrix {done[0]} of {total}" + (f" (about {left:.0f} s left)" if done[0] < total else ""))
            done[1] = now
        return result

    quantizer.node_quantizer.quantize = counted
    threads = torch.get_num_threads()
    torch.set_num_threads(HQQ_THREADS)
    try:  # (its torch.from_numpy warns that the weight array is read-only; it only reads it)
        with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            quantizer.process()
    finally:
        torch.set_num_threads(threads)
    model = quantizer.model.model
    for node in model.graph.node:  # HQQ's nodes carry no accuracy_level: the same one as RTN's
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    return model


def _round_tensors(model: ir.Model, bits: int, block_size: int, accuracy_level: int, head: list[str],
                   tied_lookups: list[str], exact: IntWeightSource | None = None) -> tuple[int, list[str]]:
    """RTN on every MatMul with a constant weight (the lm_head at 8 bits when `head` names it) and, at
    4 bits, every lookup of a constant float table but a tied one: the nodes ONNX Runtime's quantiser takes.
    A weight that `exact` holds as integers is carried over as they are instead. Returns how many were, and
    the names of the weights rounded although `exact` was given (they had no integer form there)."""
    from kvforge.exporter.quantization.rtn import quantize_lookup, quantize_matmul

    graph, carried, rounded = model.graph, 0, []
    for node in list(graph):
        if node.domain != "":
            continue
        if node.op_type == "MatMul" and len(node.inputs) == 2 and _constant(node.inputs[1]):
            specs = specs_for(node.inputs[1], exact)
            if specs is not None:
                import_matmul(graph, node, exact, specs, accuracy_level)
                carried += 1
                continue
            if exact is not None and not exact.rounds_the_rest and node.name not in head:
                continue  # a pre-quantised checkpoint's float weights stay as it has them (but an asked-for lm_head)
            if exact is not None:
                rounded.extend(source_names(node.inputs[1]))
            quantize_matmul(graph, node, 8 if node.name in head else bits, block_size, accuracy_level)
        elif node.op_type == "Gather" and bits == 4 and node.name not in tied_lookups and _constant(node.inputs[0]) \
                and (exact is None or exact.rounds_the_rest) \
                and node.inputs[0].dtype in FLOAT_TYPES:
            quantize_lookup(graph, node, block_size)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return carried, rounded


FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _constant(value: ir.Value | None) -> bool:
    return value is not None and value.is_initializer() and value.const_value is not None


def _quantize_proto(model: ir.Model, bits: int, block_size: int, accuracy_level: int, method: str, head: list[str],
                    tied_lookups: list[str], say: Callable[[str], None] | None = None) -> ir.Model:
    """ONNX Runtime's whole-model quantiser over the model's proto (every weight in memory)."""
    proto = ir.to_proto(model)
    # The quantiser's INFO lines would bury the progress; its logger is restored afterwards.
    with quiet_logger("onnxruntime.quantization"):
        if head:
            # (the quantiser's nodes_to_include does not narrow its default algorithm; exclude instead)
            others = [node.name for node in model.graph if node.op_type in ("MatMul", "Gather") and node.name not in head]
            proto = _run_quantizer(proto, 8, block_size, accuracy_level, nodes_to_exclude=others)
            return ir.from_proto(_run_quantizer(proto, 4, block_size, accuracy_level, method, say,
                                                nodes_to_exclude=head + tied_lookups))
        return ir.from_proto(_run_quantizer(proto, bits, block_size, accuracy_level, method, say,
                                            nodes_to_exclude=tied_lookups))


def quantize_model(model: ir.Model, quantize: str, block_size: int, vocab_size: int,
                   accuracy_level: int = DEFAULT_ACCURACY_LEVEL, lm_head_bits: int | None = None,
                   method: str = "rtn", whole_model: bool = False,
                   exact: IntWeightSource | None = None,
                   say: Callable[[str], None] | None = None) -> tuple[ir.Model, dict[str, Any]]:
    """The quantised model and a record of what was quantised. RTN rounds weight by weight, lazily
    (exporter/quantization/rtn.py: the weights are computed as the file is written); HQQ, and RTN with
    `whole_model` (the reference the tests hold the lazy path to), run ONNX Runtime's whole-model
    quantiser on the model in memory. `lm_head_bits=8`
    with int4 keeps the lm_head at 8 bits: on small models it carries much of int4's accuracy cost
    (SmolLM2-135M: perplexity +21.8% all-int4, +13.3% with an int8 lm_head) for more bytes per token
    (84 -> 98 MB there); see benchmarks/README.md. `method` "hqq" chooses the int4 values with ONNX
    Runtime's HQQ instead of rounding (an 8-bit lm_head is still rounded); docs/quantisation.md compares them.
    `exact`: weights already held as integers (a pre-quantised checkpoint, a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks), carried
    into MatMulNBits as they are; the others are rounded."""
    tied = _materialise_transposed_weights(model)
    # A tied embedding's lookup is left to share_tied_embedding (the lm_head's table), not quantised apart.
    tied_lookups = [node.name for node in model.graph
                    if node.op_type == "Gather" and node.inputs[0] is not None and node.inputs[0].name in tied.values()]
    vocab_nodes = _vocab_nodes(model, vocab_size)
    bits = BITS[quantize]
    head = [name for name, op in vocab_nodes.items() if op == "MatMul"] if bits == 4 and lm_head_bits == 8 else []
    carried, rounded = 0, []
    try:
        if method in ("rtn", "autoround") and not whole_model:
            quantized = model
            carried, rounded = _round_tensors(model, bits, block_size, accuracy_level, head, tied_lookups, exact)
        else:
            quantized = _quantize_proto(model, bits, block_size, accuracy_level, method, head, tied_lookups, say)
    except Exception as err:  # the quantiser raises plain exceptions for shapes it cannot handle
        raise ExportError(f"ONNX Runtime's {quantize} ({method}) quantiser failed: {type(err).__name__}: {err}") from err
    shared = share_tied_embedding(quantized, tied)
    offsets = move_float_zero_points(quantized)  # after: a table with float zero points is not shared
    ops = Counter(node.op_type for node in quantized.graph)
    bits_of = Counter(int(node.attributes["bits"].value) for node in quantized.graph
                      if node.op_type in ("MatMulNBits", "GatherBlockQuantized") and "bits" in node.attributes)
    record = {
        "method": {"rtn": "onnxruntime MatMulNBitsQuantizer (block-wise, symmetric)",
                   "hqq": "onnxruntime MatMulNBitsQuantizer, HQQ (block-wise, asymmetric, float zero points as "
                               "per-block offsets beside the integer kernel)",
                   "autoround": "AutoRound, calibrated (block-wise, asymmetric, integer zero points); lm_head and "
                                "embedding rounded"}[method],
        "quant_method": method,
        "bits": bits, "block_size": block_size, "accuracy_level": accuracy_level,
        "matmuls_quantized": ops.get("MatMulNBits", 0),
        "matmuls_left_fp32": ops.get("MatMul", 0) - offsets,  # (not the offsets' own small products)
        "embedding_quantized": ops.get("GatherBlockQuantized", 0) > 0,
        "embedding_shares_lm_head": shared > 0,  # a tied embedding looked up in the lm_head's table
        "nodes_by_bits": {str(b): n for b, n in sorted(bits_of.items())},
        "lm_head_bits": 8 if bits == 4 and lm_head_bits == 8 and vocab_nodes else bits,
    }
    if offsets:  # float zero points (HQQ's, a GGUF's Q4_1/Q4_K) run as offsets beside the integer kernel
        record["float_zero_points_as_offsets"] = offsets
    if exact is not None:
        record["integer_weights"] = {"source": exact.kind, "carried_over": carried,
                                     "rounded": sorted(name.removeprefix("model.") for name in set(rounded))}
    return quantized, record
