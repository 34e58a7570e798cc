"""The canonical graphs: one dynamo trace of the prefill graph, and the decode graph derived from it.

The model runs inside GraphWrapper (exporter/wrapper.py), which routes attention through the kvforge
op; the graph's inputs and outputs are named by the contract (kvforge/contract.py).
"""

from __future__ import annotations

import contextlib
import io as io_module
import logging
import warnings
from typing import Any

import numpy as np

from kvforge.contract import INPUT_IDS, LOGITS, LOGITS_INDEX, LOGITS_POSITIONS, PAST_LENS, GraphIO, KVLayout

OPSET = 24
# Example sizes for tracing; every one of these dimensions is dynamic in the graphs.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_CAPACITY = 2, 8, 32


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR):
    """Raise another library's logger level for the duration only, so an embedding application's
    logging setup is left as it was."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def trace_prefill(model: Any, layout: KVLayout, torch_dtype: Any) -> Any:
    """The canonical prefill graph (an onnx_ir model): attention as one kvforge node per layer, every
    batch, sequence, position and capacity dimension dynamic, IO named by the contract."""
    import torch
    from torch.export import Dim

    from kvforge.exporter.wrapper import GraphWrapper
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    batch_dim, seq_dim, capacity_dim, k_dim = Dim("batch"), Dim("seq"), Dim("capacity"), Dim("positions")
    seq, b = _EXAMPLE_SEQ, _EXAMPLE_BATCH
    cache = [torch.zeros(layout.shape(b, _EXAMPLE_CAPACITY), dtype=torch_dtype) for _ in layout.buffers()]
    args: list[torch.Tensor] = [torch.ones(b, seq, dtype=torch.int64), torch.zeros(b, dtype=torch.int32)]
    # Two positions per row in the example, so the positions dimension stays dynamic.
    args.append(torch.tensor([[seq - 2, seq - 1]] * b, dtype=torch.int64))
    rest_shapes: list[dict] = [{0: batch_dim, 1: k_dim}] + [{0: batch_dim, 2: capacity_dim} for _ in cache]
    io = GraphIO.of("prefill", layout)
    # torch.onnx prints its steps to stdout and warns about torchvision; keep stdout for --json.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            GraphWrapper(model, "prefill"),
            tuple(args + cache),
            dynamo=True,
            input_names=list(io.inputs),
            output_names=list(io.outputs),
            dynamic_shapes=({0: batch_dim, 1: seq_dim}, {0: batch_dim}, tuple(rest_shapes)),
            custom_translation_table=CUSTOM_TRANSLATION_TABLE,
            opset_version=OPSET,
            optimize=False,  # optimize_graph() below does the part of it these graphs need, 5x faster
            verbose=False,
        )
    return program.model


def derive_decode_graph(prefill: Any) -> Any:
    """decode.onnx from the canonical prefill graph, without a second trace: the same graph with
    input_ids [B, 1], the `logits_index` input replaced by zeros [B, 1] (the one new position) and
    logits [B, 1, V] squeezed to [B, V]. The clone shares the weight tensors."""
    import onnx_ir as ir

    model = prefill.clone()
    graph = model.graph
    by_name = {value.name: value for value in graph.inputs}
    index, past_lens, ids = by_name[LOGITS_INDEX], by_name[PAST_LENS], by_name[INPUT_IDS]
    tape = ir.tape.Tape()
    batch = tape.op("Shape", [past_lens])
    one = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64), name="kvforge_one_d")})
    shape = tape.op("Concat", [batch, one], attributes={"axis": 0})
    zeros = tape.op("ConstantOfShape", [shape], attributes={"value": ir.tensor(np.array([0], np.int64))})
    graph.insert_before(graph.node(0), tape.nodes)
    index.replace_all_uses_with(zeros)
    graph.inputs.remove(index)
    ids.shape = ir.Shape([ids.shape[0], 1])
    position = next(i for i, value in enumerate(graph.outputs) if value.name == LOGITS)
    per_position = graph.outputs[position]
    per_position.name = LOGITS_POSITIONS
    squeeze = ir.tape.Tape()
    logits = squeeze.op("Squeeze", [per_position, one], output=ir.Value(name=LOGITS))
    graph.extend(squeeze.nodes)
    logits.dtype, logits.shape = per_position.dtype, ir.Shape([per_position.shape[0], per_position.shape[2]])
    graph.outputs[position] = logits
    return model
