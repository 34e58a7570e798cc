"""A target as the exporter sees it, resolved once (ExportOptions.resolve): its registry entry of
kvforge/core/targets.py (the runtime's and the build's part), its passes, what its attention op takes, and the
refusals it owns (`check_options`, `check_model` before loading, `check_probed` after the attention shapes are
probed). One instance per target module; a target with a kernel of its own adds its refusals as hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx_ir as ir

from kvforge.core.contract import ATTENTION_INPUTS, ATTENTION_OPTIONAL_INPUTS, KV_CACHE_DTYPES, KVLayout
from kvforge.core.errors import InputError, UnsupportedModelError
from kvforge.core.targets import Target


@dataclass(frozen=True)
class ExportTarget:
    core: Target  # the runtime's and the build's part
    # (graph, canonical attention nodes, rotary cos/sin caches or None, per-layer KV scales or None): rewrites
    # every canonical node in place. A target whose fusions it does not run ignores `rotary`.
    lower_attention: Callable[..., Any]
    # (graph, (bits, block size) for the experts' weights or None): rewrites the canonical MoE nodes.
    lower_moe: Callable[..., Any]
    # ONNX Runtime's contrib fusions (normalization, rotary folded into the attention op).
    ort_fusions: bool = False
    quantize: bool = False  # `--quantize` (MatMulNBits, an ONNX Runtime contrib op)
    # `--kv-cache` dtypes its attention op reads and writes.
    kv_cache_dtypes: tuple[str, ...] = ()
    # The head sizes its attention op takes are multiples of this.
    head_dim_multiple: int = 1
    # Dtypes where a gate/up pair merged into one MatMul pays even unquantised (ONNX Runtime CUDA's: at batch 1
    # each MatMul is one ~3.5 us cuBLAS kernel on an H100; benchmarks/README.md).
    merge_pairs_dtypes: tuple[str, ...] = ()
    # The target's own refusals of a model, where it runs a kernel of its own: (target, config, family, dtype)
    # before anything is loaded; (target, config, family, dtype, probed layout, sinks) after the probe.
    refuse_model: Callable[..., None] | None = None
    refuse_probed: Callable[..., None] | None = None
    images: bool = True  # a vision-language export (vision.onnx, image features into prefill)
    drafts: bool = True  # `--eagle`: a speculation head's draft.onnx beside the graphs (exporter/draft_head.py)
    # Every registered target, this one included: what a refusal names instead. Handed in by the registry
    # (exporter/targets/__init__.py, `among`), so this module never imports it; empty on a module's own TARGET.
    peers: tuple[ExportTarget, ...] = field(default=(), compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.core.name

    def among(self, targets: Iterable[ExportTarget]) -> ExportTarget:
        """This target as the registry holds it: knowing `targets`, the registered ones."""
        return replace(self, peers=tuple(targets))

    def others(self, takes: Callable[[ExportTarget], bool]) -> str:
        """"--target a or --target b": the registered targets without a kernel of their own that `takes` accepts."""
        return " or ".join(f"--target {t.name}" for t in self.peers if t.refuse_model is None and takes(t))

    def check_options(self, options: Any) -> None:
        """The export options this target cannot honour, refused in one line naming another that can."""
        if options.quantize is not None and not self.quantize:
            raise InputError(f"--quantize produces ONNX Runtime's MatMulNBits: use it with --target ort, not {self.name}")
        if getattr(options, "eagle", None) is not None and not self.drafts:
            raise InputError(f"--eagle is not supported with --target {self.name} (its engines have no draft.onnx path "
                             "yet); export with --target ort or --target onnx")
        if options.kv_cache is None:
            return
        if options.kv_cache not in KV_CACHE_DTYPES:
            raise InputError(f"--kv-cache takes {', '.join(KV_CACHE_DTYPES)}, not {options.kv_cache!r}")
        if options.kv_cache not in self.kv_cache_dtypes:
            able = [t.name for t in self.peers if options.kv_cache in t.kv_cache_dtypes]
            raise InputError(
                f"--kv-cache {options.kv_cache}: the {self.name} target's attention ({self.core.summary}) has no "
                f"quantised cache; use --target {' or '.join(able)}"
            )
        if options.dtype != "fp32":
            raise InputError(f"--kv-cache {options.kv_cache} is measured with fp32 activations only; drop --dtype "
                             f"{options.dtype}")

    def check_model(self, config: Any, family: Any, dtype: str) -> None:
        """Before anything is loaded: what the target refuses of this model (its config and family)."""
        if self.refuse_model is not None:
            self.refuse_model(self, config, family, dtype)

    def check_probed(self, config: Any, family: Any, dtype: str, layout: KVLayout, sinks: bool) -> None:
        """After the probe: the head sizes the target's attention op takes, and the target's own refusals."""
        for head_dim in sorted({dim for _, dim in layout.layer_shapes()}):
            if head_dim % self.head_dim_multiple:
                raise UnsupportedModelError(
                    f"{config.model_type}: its head size {head_dim} is not a multiple of {self.head_dim_multiple}, "
                    f"which --target {self.name}'s attention ({self.core.summary.split(' (')[0]}) needs; use "
                    f"{self.others(lambda t, dim=head_dim: dim % t.head_dim_multiple == 0)}")
        if self.refuse_probed is not None:
            self.refuse_probed(self, config, family, dtype, layout, sinks)


def optional_input(node: ir.Node, name: str) -> ir.Value | None:
    """The canonical node's optional input `name` (kvforge.core.contract.ATTENTION_OPTIONAL_INPUTS), None when absent."""
    index = len(ATTENTION_INPUTS) + ATTENTION_OPTIONAL_INPUTS.index(name)
    inputs = list(node.inputs)
    return inputs[index] if len(inputs) > index else None


def alibi_input(node: ir.Node) -> ir.Value | None:
    """The canonical node's optional `alibi_slopes` input ([H] fp32), None when absent."""
    return optional_input(node, "alibi_slopes")


def bias_input(node: ir.Node) -> ir.Value | None:
    """The canonical node's optional `attention_bias` input ([B or 1, H, S, C], added to the scores), None when
    absent."""
    return optional_input(node, "attention_bias")


def alibi_bias(tape: ir.tape.Tape, slopes: ir.Value, query_pos: ir.Value, key_pos: ir.Value, heads: int,
               dtype: ir.DataType | None) -> ir.Value:
    """ALiBi's additive bias [B, H, S, T] = slope_h * (key_pos - query_pos) from query positions [B, 1, S, 1] and
    key positions [T] (int64). HF adds slope_h * key_pos; the softmax of a query row ignores the per-row shift,
    and the relative form stays small at long positions. Computed in fp32, cast to the activations' `dtype`."""
    from kvforge.exporter.graph_edit import constant

    distance = tape.op("Cast", [tape.op("Sub", [key_pos, query_pos])], attributes={"to": ir.DataType.FLOAT})
    per_head = tape.op("Reshape", [slopes, constant(tape, np.array([1, heads, 1, 1], np.int64), None)])
    bias = tape.op("Mul", [per_head, distance])
    if dtype is not None and dtype != ir.DataType.FLOAT:
        bias = tape.op("Cast", [bias], attributes={"to": dtype})
    return bias


def shared_key(value: ir.Value) -> object:
    """A key under which equal constant inputs (every layer's copy of the same slopes) share one computed value."""
    tensor = value.const_value
    return (tensor.numpy().tobytes(), str(tensor.dtype)) if tensor is not None else id(value)
