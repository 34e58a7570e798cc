"""The canonical graphs of an encoder-decoder: one dynamo trace of the encoder, one of the decoder's prefill (its
decode derived as a decoder-only model's: exporter/trace.py). IO named by kvforge/core/encoder_contract.py."""

from __future__ import annotations

import contextlib
import io as io_module
import warnings
from typing import Any

from kvforge.core.contract import KV_KINDS, KVLayout
from kvforge.core.encoder_contract import decoder_io, encoder_io
from kvforge.core.progress import quiet_logger
from kvforge.exporter.trace import OPSET

# Example sizes for tracing; every one of these dimensions is dynamic in the graphs (Whisper's frames aside).
_BATCH, _SEQ, _CAPACITY, _ENCODER_SEQ = 2, 8, 32, 12


def _export(module: Any, args: tuple, names: Any, dynamic_shapes: tuple) -> Any:
    import torch

    from kvforge.plugins.cross_op import CUSTOM_TRANSLATION_TABLE as CROSS_TRANSLATION
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    # torch.onnx prints its steps to stdout and warns about torchvision; keep stdout for --json.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=list(names.inputs), output_names=list(names.outputs),
            dynamic_shapes=dynamic_shapes, custom_translation_table={**CUSTOM_TRANSLATION_TABLE, **CROSS_TRANSLATION},
            opset_version=OPSET, optimize=False, verbose=False)
    return program.model


def trace_encoder(model: Any, family: Any, torch_dtype: Any) -> Any:
    """encoder.onnx's canonical graph: batch (and, for token ids, the length) dynamic."""
    import torch
    from torch.export import Dim

    from kvforge.exporter.seq2seq_wrapper import EncoderWrapper

    batch = Dim("batch")
    config = model.config
    if family.input == "ids":
        args = (torch.ones(_BATCH, _ENCODER_SEQ, dtype=torch.int64),
                torch.tensor([_ENCODER_SEQ, _ENCODER_SEQ - 3], dtype=torch.int32))
        shapes = ({0: batch, 1: Dim("encoder_seq")}, {0: batch})
    else:  # Whisper's encoder takes exactly its window's frames: two per position
        frames = 2 * config.max_source_positions
        args = (torch.zeros(_BATCH, config.num_mel_bins, frames, dtype=torch.float32),)
        shapes = ({0: batch},)
    names = encoder_io(family.input, family.decoder_layers(config))
    return _export(EncoderWrapper(model, family), args, names, (shapes,))  # forward(*inputs): one tuple


def trace_decoder(model: Any, family: Any, layout: KVLayout, torch_dtype: Any) -> Any:
    """The decoder's canonical prefill graph: batch, sequence, positions, capacity and encoder length dynamic."""
    import torch
    from torch.export import Dim

    from kvforge.exporter.seq2seq_wrapper import DecoderWrapper

    batch, seq, capacity, positions, encoder_seq = (Dim(n) for n in ("batch", "seq", "capacity", "positions",
                                                                    "encoder_seq"))
    heads, head_dim = family.heads(model.config)
    args: list[Any] = [torch.ones(_BATCH, _SEQ, dtype=torch.int64), torch.zeros(_BATCH, dtype=torch.int32),
                       torch.tensor([[_SEQ - 2, _SEQ - 1]] * _BATCH, dtype=torch.int64),
                       torch.tensor([_ENCODER_SEQ, _ENCODER_SEQ - 3], dtype=torch.int32)]
    shapes: list[Any] = [{0: batch, 1: seq}, {0: batch}, {0: batch, 1: positions}, {0: batch}]
    for _ in range(2 * layout.num_layers):  # cross keys and values
        args.append(torch.zeros(_BATCH, heads, _ENCODER_SEQ, head_dim, dtype=torch_dtype))
        shapes.append({0: batch, 2: encoder_seq})
    for layer, kind in layout.buffers():
        assert kind in KV_KINDS
        args.append(torch.zeros(layout.buffer_shape(_BATCH, _CAPACITY, layer, kind), dtype=torch_dtype))
        shapes.append({0: batch, 2: capacity})
    names = decoder_io("prefill", layout)
    # GraphWrapper's convention: the first two inputs by position, the rest as one tuple.
    return _export(DecoderWrapper(model, family), tuple(args), names, (shapes[0], shapes[1], tuple(shapes[2:])))
