"""The options of `kvforge export` (ExportOptions): what an export makes of a model, checked against the target by
`resolve()` before any work. A module of its own, so that the target and the quantisation plan can name it
without importing the export's orchestration (exporter/export.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvforge.core.contract import DTYPES
from kvforge.core.errors import InputError
from kvforge.exporter.quantization.plan import check_options as check_quantize
from kvforge.exporter.targets import ExportTarget, export_target


@dataclass(frozen=True)
class ExportOptions:
    """What `kvforge export` makes of a model (checked by `resolve()` before any work)."""

    target: str = "ort"
    dtype: str = "fp32"
    quantize: str | None = None  # "int4" | "int8": MatMulNBits weights (targets with `quantize`)
    block_size: int = 32
    accuracy_level: int = 4
    lm_head_bits: int | None = None  # 8: an 8-bit lm_head with int4
    # "rtn" | "hqq" | "autoround": how int4 values are chosen (exporter/quantization/plan.py METHODS); None: the default
    # (exporter/quantization/plan.py _choose: hqq for int4 under 1B parameters in fp32, else autoround or rtn)
    quant_method: str | None = None
    calibration: str | Path | None = None  # autoround's calibration text (default: kvforge's own)
    kv_cache: str | None = None  # "int8": a quantised KV cache (targets with `kv_cache_dtypes`; exporter/quantization/kv_cache.py)
    force: bool = False  # replace an existing export at the output
    hf_dir: str | Path | None = None  # where a GGUF input is converted (default OUT_DIR.hf)
    # gate/up MatMuls merged into one: None = where it pays (int4/int8, ort fp16/bf16: optimize.fuse_graph);
    # the Python API's switch for benchmarks that compare the two graphs
    merge_pairs: bool | None = None
    # Stream the weights from the checkpoint's shards into the weights file (exporter/lazy_weights.py) where
    # the model allows it; False: load the whole model first, as exports did before streaming
    stream: bool = True
    # Streamed, trace two of a model's alike layers and stamp the rest (exporter/layer_stamping.py); False:
    # trace every layer (the Python API's switch, for tests that compare the two)
    stamp: bool = True
    # A vision-language checkpoint (models/vision_families.py) is exported whole, vision.onnx included; True: its
    # text model alone, as exports did before vision.onnx
    text_only: bool = False
    # A checkpoint's multi-token-prediction layer exported as the speculation head draft.onnx (exporter/mtp_head.py)
    # where it ships one; False (--no-mtp): the target alone
    mtp: bool = True
    eagle: str | Path | None = None  # an EAGLE-3 head's folder, exported as draft.onnx (exporter/draft_head.py)
    draft_lm_head_bits: int | None = None  # 8 or 4: draft.onnx's lm_head as MatMulNBits (exporter/quantization/draft_lm_head.py)

    def resolve(self) -> ExportTarget:
        """The target, resolved once, after checking every option against it."""
        target = export_target(self.target)
        if self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_quantize(self, target.name)
        target.check_options(self)
        return target
