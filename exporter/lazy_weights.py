"""Exporting without holding the model: the trace sees weights without values, the graph reads them late.

The graphs do not depend on weight values, so the model is built with its parameters as fake tensors
(torch's FakeTensorMode: a shape and a dtype, no storage) and traced like that; its buffers (rotary
tables and the like, computed at construction and not in the checkpoint) are real. Each initializer
then gets an `onnx_ir.LazyTensor` that reads its tensor from the safetensors shards when the weights
file is written, one tensor at a time, cast to the export's dtype there. Fusions and quantisation
compose lazy tensors the same way (`lazy`), so the export's memory is bounded by its largest tensor.

A model streams when transformers would load its checkpoint by plain names (each parameter one
tensor of the same shape; a multimodal checkpoint's text model by its renamed tensors: exporter/text_stream.py)
and nothing in the export computes new weights from the loaded values (family adapters, experts rewritten for
the MoE node, a calibrated KV cache, HQQ's whole-model quantiser); otherwise it is loaded whole, as before, and
the export says why.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.models.checkpoint_names import (
    mismatch_line,
    missing_line,
    refuse_unexpected,
    unexpected_tensors,
)

# The GraphWrapper holds the HF model as `model`: torch.onnx names initializers by that path.
WRAPPER_PREFIX = "model."


@dataclass
class EmptyModel:
    """A model whose parameters are fake tensors of `fake_mode`, and where each one's values are."""

    model: Any
    fake_mode: Any
    # initializer name (as torch.onnx names it) -> checkpoint tensor name
    sources: dict[str, str]


class Gap(str):
    """Why an export does not stream that is the checkpoint's own (a tensor missing by its name, one of another
    shape), with the one line that refuses it should transformers not load the folder whole either."""

    refusal: str

    def __new__(cls, reason: str, refusal: str) -> Gap:
        gap = super().__new__(cls, reason)
        gap.refusal = refusal
        return gap


def streaming_refusal(config: Any, options: Any, family: Any, plan: Any) -> str | None:
    """Why this export cannot stream its weights, before any model is built (None: it may); `plan`: the export's
    quantisation plan (exporter/quantization/plan.py)."""
    if options.kv_cache is not None:
        return f"--kv-cache {options.kv_cache} calibrates its scales by running the model"
    if plan.quantize is not None and plan.method == "hqq":
        return f"--quant-method {plan.method} runs ONNX Runtime's whole-model quantiser"
    # A patch that only changes the model's code (its family says so) runs on the fake weights too.
    if family.patch is not None and not family.patch_keeps_weights:
        return f"{config.model_type}'s export adapter rewrites weights from their values"
    return None


def empty_model(config: Any, torch_dtype: Any, checkpoint: Any, family: Any,
                model_class: Any = None) -> tuple[EmptyModel | None, str | None]:
    """The model (of `model_class`, default the causal-LM class transformers maps the config to) with fake parameters
    and real buffers, and the checkpoint tensor of each initializer;
    or None and why it cannot stream (a parameter the checkpoint does not hold by its name and shape: a Gap,
    experts that the MoE preparation rebuilds from their values). A checkpoint tensor that no parameter or buffer
    reads, once all were found, is refused (InputError naming it)."""
    import torch
    from accelerate import init_empty_weights
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.experts_routing import looped_experts_count

    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers computed for real
        model = (model_class._from_config if model_class is not None else AutoModelForCausalLM.from_config)(
            config, attn_implementation="eager", dtype=torch_dtype)
    model.tie_weights()  # as from_pretrained does: a tied lm_head is the embedding's parameter
    model.eval()
    if getattr(model, "_can_set_experts_implementation", lambda: False)() or looped_experts_count(model, family):
        return None, "its experts are rebuilt from their values for the MoE node"
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    sources: dict[str, str] = {}
    for aliases in names.values():
        found = next((name for name in aliases if name in checkpoint), None)
        if found is None:  # renamed or merged by transformers' loader, or missing: the whole-model load tells
            return None, Gap(f"the checkpoint has no tensor named {aliases[0]} (transformers may rename or merge "
                             "tensors as it loads them)", missing_line(checkpoint.model_dir, [aliases[0]]))
        parameter = model.get_parameter(aliases[0])
        stored, wanted = list(checkpoint.info(found).shape), list(parameter.shape)
        if stored != wanted:
            return None, Gap(f"the checkpoint's {found} is {stored}, the model's {wanted}",
                             mismatch_line(checkpoint.model_dir, found, stored, wanted))
        for alias in aliases:
            sources[WRAPPER_PREFIX + alias] = found
    for name, _ in model.named_buffers():
        if name in checkpoint:  # a persistent buffer saved with the weights: its saved values, as from_pretrained
            sources[WRAPPER_PREFIX + name] = name
    # Every parameter found by its name and shape: a tensor left over is one transformers would drop too.
    refuse_unexpected(checkpoint.model_dir, model,
                      unexpected_tensors(model, checkpoint.names, set(sources.values())))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, Any] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in fakes:  # tied parameters stay one parameter
                with fake_mode:
                    fakes[id(parameter)] = torch.nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype),
                                                              requires_grad=False)
            module._parameters[name] = fakes[id(parameter)]
    return EmptyModel(model, fake_mode, sources), None


def attach_weights(model: ir.Model, empty: EmptyModel, checkpoint: Any) -> int:
    """Give every initializer the trace left without values (a fake tensor) a lazy read of its checkpoint
    tensor, in the initializer's dtype. Returns how many. An initializer without a source is an error: the
    export would otherwise write a tensor it cannot read."""
    attached = 0
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if not _is_fake(tensor) and name not in empty.sources:
            continue
        source = empty.sources.get(name)
        if source is None:  # (e.g. a table the model computes in its forward): the export loads the model whole
            raise RuntimeError(f"the traced graph has a tensor {name} without values that the checkpoint does not hold")
        value.const_value = checkpoint_tensor(checkpoint, source, value.dtype, tuple(value.shape), name)
        attached += 1
    return attached


def _is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(tensor, "raw", None), FakeTensor)


def checkpoint_tensor(checkpoint: Any, source: str, dtype: ir.DataType, shape: tuple, name: str) -> ir.LazyTensor:
    """A lazy tensor: the checkpoint's `source` tensor, read when written, cast to `dtype`."""
    from onnx_ir.tensor_adapters import TorchTensor

    from kvforge.core.contract import DTYPES

    def read() -> ir.TensorProtocol:
        import torch

        target = getattr(torch, DTYPES.get(_DTYPE_NAMES.get(dtype, ""), "float32"))
        return TorchTensor(checkpoint.read(source).to(target).reshape(shape), name=name)

    def stored() -> np.ndarray:
        return _numpy(checkpoint.read(source)).reshape(shape)

    return _Lazy(read, dtype=dtype, shape=ir.Shape(shape), name=name, stored=stored)


def _numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as numpy in its own dtype (bf16 as ml_dtypes' bfloat16), without a copy."""
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class _Lazy(ir.LazyTensor):
    """A lazy tensor that can also give its values in the dtype they are stored in (`stored_array`): a
    quantiser widens a bf16 checkpoint's weight a slice at a time instead of the whole tensor to fp32."""

    def __init__(self, *args: Any, stored: Callable[[], np.ndarray] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stored = stored

    def tofile(self, file: Any) -> None:
        """Write the bytes without the extra copy `tobytes` makes (onnx-ir's path for a file without fileno)."""
        tensor = self._evaluate()
        array = tensor.numpy() if type(tensor).__name__ in ("Tensor", "TorchTensor") else None
        if array is None or sys.byteorder != "little" or array.dtype.itemsize * 8 != self.dtype.bitwidth:
            tensor.tofile(file)
            return
        file.write(contiguous(array, array.dtype).reshape(-1).view(np.uint8))


def stored_array(tensor: Any) -> np.ndarray:
    """`tensor`'s values in their stored dtype where it knows them (a checkpoint read, a transpose of one),
    else `tensor.numpy()`: the same values either way, once widened."""
    stored = getattr(tensor, "stored", None)
    return stored() if stored is not None else np.asarray(tensor.numpy())


_DTYPE_NAMES = {ir.DataType.FLOAT: "fp32", ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16"}


def lazy(compute: Callable[[], np.ndarray], dtype: ir.DataType, shape: tuple[int, ...], name: str,
         stored: Callable[[], np.ndarray] | None = None) -> ir.LazyTensor:
    """A tensor computed from others when it is written (a fusion's concatenation, a transposed copy,
    a cast): nothing is read or held before then, and the result is dropped once written. `compute` may
    give another float dtype (a checkpoint's bf16): it is cast to `dtype` here, a block at a time for a
    large strided view (a transposed table), so no second whole copy is made."""

    def make() -> Any:
        array = compute()
        if array.flags.c_contiguous or array.ndim < 2 or array.nbytes <= _RowBlocks.COPY_BYTES:
            return ir.Tensor(contiguous(array, dtype.numpy()), dtype=dtype, name=name)
        return _RowBlocks(array, dtype, name)

    return _Lazy(make, dtype=dtype, shape=ir.Shape(list(shape)), name=name, stored=stored)


class _RowBlocks:
    """A large strided view (a transposed weight) written a block of rows at a time, cast to `dtype` block by
    block: no contiguous copy of the whole (an 8B model's 1 GB lm_head), and 5x faster than numpy's own
    strided write. Only what the weights writer and a quantiser ask of a tensor."""

    BLOCK_BYTES = 16 << 20
    COPY_BYTES = 256 << 20  # smaller views are copied whole (faster than blocks, and bounded)

    def __init__(self, array: np.ndarray, dtype: ir.DataType, name: str) -> None:
        self.array, self.dtype, self.name = array, dtype, name
        self.shape = ir.Shape(list(array.shape))

    @property
    def nbytes(self) -> int:
        return int(self.array.size * self.dtype.itemsize)

    def numpy(self) -> np.ndarray:
        return contiguous(self.array, self.dtype.numpy())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()

    def tofile(self, file: Any) -> None:
        rows = max(1, int(self.BLOCK_BYTES // max(1, self.array[0].size * self.dtype.itemsize)))
        for start in range(0, self.array.shape[0], rows):
            file.write(contiguous(self.array[start:start + rows], self.dtype.numpy()).reshape(-1).view(np.uint8))


def contiguous(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array` in C order and `dtype`. A strided view (a transposed weight) is copied by torch, ~6x faster
    than numpy's strided copy of 2-byte values; the bytes are moved as integers of the same width, which
    torch has for every dtype (bf16 as ml_dtypes' type is foreign to it), then cast contiguously."""
    if not array.flags.c_contiguous and array.ndim >= 2 and array.size and array.itemsize in (1, 2, 4, 8) \
            and min(array.strides) >= 0:
        import torch

        ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[array.itemsize]
        with warnings.catch_warnings():  # a read-only checkpoint map: torch warns, and only reads it
            warnings.simplefilter("ignore", UserWarning)
            array = torch.from_numpy(array.view(ints)).contiguous().numpy().view(array.dtype)
    return np.ascontiguousarray(array, dtype=dtype)


def transpose_weights_lazily(model: ir.Model) -> int:
    """Transpose(W) of a weight read by that node alone -> W transposed as a lazy initializer.

    onnxscript's constant folding always folds such a Transpose, whatever its size, into a new tensor in
    memory: every linear layer's weight, i.e. the whole model (a 1B export held 1.9 GB of them). This does
    the same fold without reading anything. Returns how many were folded."""
    graph, folded = model.graph, 0
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
        if source is None or not source.is_initializer() or source.const_value is None or len(source.uses()) != 1 \
                or source.is_graph_input() or source.is_graph_output():
            continue
        tensor = source.const_value
        rank = len(tensor.shape)
        perm = list(node.attributes.get_ints("perm", list(range(rank))[::-1]))
        shape = tuple(int(tensor.shape[i]) for i in perm)
        name = f"{source.name}.T" if perm == [1, 0] else f"{source.name}.perm{''.join(map(str, perm))}"
        value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=source.type,
                         const_value=transposed(tensor, perm, name))
        graph.register_initializer(value)
        node.outputs[0].replace_all_uses_with(value, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        folded += 1
    return folded


def transposed(tensor: ir.TensorProtocol, perm: list[int] | None, name: str) -> ir.LazyTensor:
    """`tensor` transposed (reversed axes without `perm`), computed when written; its stored values too."""
    shape = tuple(tensor.shape)
    order = list(perm) if perm is not None else list(range(len(shape)))[::-1]
    return lazy(lambda: stored_array(tensor).transpose(order), tensor.dtype, tuple(shape[i] for i in order),
                name, stored=lambda: stored_array(tensor).transpose(order))


_PAGEOUT = 21  # Linux's MADV_PAGEOUT (5.4+)


def release_pages(view: np.ndarray) -> None:
    """Hand back the memory pages under `view` (a slice of a checkpoint tensor that has been used): a
    mapped file's pages leave the process's resident memory and are read again if touched, so a
    quantiser walking a 1 GB table holds a slice of it, not all it has read. MADV_PAGEOUT drops only what
    it can reclaim without loss: an anonymous copy (no swap here) stays, and elsewhere it is a no-op."""
    if not sys.platform.startswith("linux") or view.size == 0 or min(view.strides, default=0) < 0:
        return
    import ctypes
    import mmap

    start = view.__array_interface__["data"][0]
    end = start + sum((dim - 1) * stride for dim, stride in zip(view.shape, view.strides, strict=True)) + view.itemsize
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _PAGEOUT)
