"""Greedy picks on the device (ort-cuda): the argmax of a decode step's logits computed where they are.

A bare-greedy decode step (no sampling, controls, logprobs or kept logits) needs one token per row,
not the [B, V] logits: on a GPU, copying them to the host and converting fp16 to float32 there costs
more than the argmax itself. A two-node graph, run over the slot's device logits buffer, gives

    token [B] int64  = ArgMax(scores, axis=-1)     (scores: the step's logits; ONNX: the first index of the maximum)
    total [B] their dtype = ReduceSum(scores, axis=-1)

`total` is the NaN check: a sum is NaN exactly when the row holds a NaN (or both +inf and -inf, which
is as broken), so B numbers stand in for the [B, V] scan the host path does. Both come back in one
copy of a small device buffer.

A separate session rather than extra outputs of decode.onnx: the export's graphs (the KV-cache contract)
stay as they are, old exports get it too, and the backend decides per step whether logits come back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from importlib.resources import files

import numpy as np
import onnxruntime as ort

# numpy dtype of the logits -> the pick graph for them (numpy has no bfloat16). The graphs are stored
# files, ~250 bytes each, so the runtime needs no `onnx` package; tests/runtime/test_device_path.py rebuilds
# them with onnx.helper and checks the files are exactly that graph (dims "batch" and "vocab", opset 18).
PICK_DTYPES = {np.dtype(np.float16): "device_pick_float16.onnx", np.dtype(np.float32): "device_pick_float32.onnx"}


def pick_model_bytes(dtype: np.dtype) -> bytes:
    """The serialized pick graph for [batch, vocab] logits of `dtype` (float16 or float32)."""
    return (files("kvforge") / "data" / PICK_DTYPES[np.dtype(dtype)]).read_bytes()


class DevicePicker:
    """The pick session of one backend; `bind` gives each slot its own binding over its logits buffer.

    On a GPU the pick is captured as a CUDA graph per slot too (ONNX Runtime's `enable_cuda_graph`, one
    `gpu_graph_id` per binding): its input (the slot's logits) and its outputs (`token` and `total`, side
    by side in one small device buffer) have fixed addresses, so a step costs a graph replay and one
    copy of 16 bytes per row to the host. Where ONNX Runtime will not capture it, it runs op by op."""

    def __init__(self, dtype: np.dtype, device: str, device_id: int = 0,
                 cuda_graphs: bool = True) -> None:
        self.dtype = np.dtype(dtype)
        self.device, self.device_id = device, device_id
        model = pick_model_bytes(self.dtype)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.cuda_graphs = device == "cuda" and cuda_graphs
        cuda = {"device_id": str(device_id)}
        if self.cuda_graphs:
            try:
                self.session = ort.InferenceSession(
                    model, sess_options=options,
                    providers=[("CUDAExecutionProvider", {**cuda, "enable_cuda_graph": "1"}), "CPUExecutionProvider"])
                self._graph_ids = itertools.count(1)
                return
            except Exception:  # ONNX Runtime would not capture it: run it op by op
                self.cuda_graphs = False
        providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(model, sess_options=options, providers=providers)

    def bind(self, logits: ort.OrtValue, batch: int) -> PickBinding:
        """A binding reading `logits` (the slot's device [B, V] buffer) into one device buffer holding
        token (int64 [B]) then total ([B], the logits' dtype)."""
        out = ort.OrtValue.ortvalue_from_shape_and_type([batch * (8 + self.dtype.itemsize)], np.uint8,
                                                        self.device, self.device_id)
        binding = self.session.io_binding()
        binding.bind_ortvalue_input("scores", logits)
        binding.bind_output("token", self.device, self.device_id, np.int64, [batch], out.data_ptr())
        binding.bind_output("total", self.device, self.device_id, self.dtype, [batch], out.data_ptr() + 8 * batch)
        options = ort.RunOptions()
        options.log_severity_level = 4
        options.add_run_config_entry("gpu_graph_id", str(next(self._graph_ids)) if self.cuda_graphs else "-1")
        return PickBinding(binding, out, batch, options)

    def run(self, pick: PickBinding) -> tuple[np.ndarray, np.ndarray]:
        """(token [B] int64, total [B]) of the logits now in the bound buffer."""
        self.session.run_with_iobinding(pick.binding, pick.options)
        raw = pick.out.numpy()
        return raw[: 8 * pick.batch].view(np.int64), raw[8 * pick.batch:].view(self.dtype)


@dataclass
class PickBinding:
    binding: ort.IOBinding
    out: ort.OrtValue  # token then total, one device buffer (one copy back)
    batch: int
    options: ort.RunOptions
