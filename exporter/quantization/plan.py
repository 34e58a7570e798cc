"""The quantisation plan: what an export makes integers of, how, and why, resolved once per export.

The export's one entry into exporter/quantization/ (generic exporter modules import this module only):
- `check_options` refuses options that cannot go together (ExportOptions.resolve, before any work);
- the input is classified once: `read_layout` (a pre-quantised checkpoint's layout), `prequantized_twin` (its
  integers and the dequantised folder traced), `classify` (the source the plan depends on, from the checkpoint the
  export opened);
- `QuantPlan.resolve(options, source)` decides, in `_choose`, the two defaults that depend on the model (the int4
  method and the lm_head's bits) with their reasons, and where the integers come from;
- `integer_weights` gives the integers carried over (a pre-quantised checkpoint's, a GGUF's blocks, AutoRound's),
  and `QuantPlan.apply` quantises the traced graph (apply.py). The manifest's quantisation record carries
  `QuantPlan.record()`, so `kvforge inspect` shows the reasons an export was made with.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError
from kvforge.exporter.quantization.choices import (
    ACCURACY_LEVELS,
    BITS,
    BLOCK_SIZES,
    DEFAULT_ACCURACY_LEVEL,
    DRAFT_LM_HEAD_BITS,
    METHODS,
    SMALL_MODEL_PARAMETERS,
)

# The input, classified once for quantisation: a pre-quantised checkpoint (its layout read once, its integers
# carried over, traced from its dequantised twin), a GGUF's conversion (its Q4_0/Q4_1/Q4_K/Q8_0 blocks), or an
# ordinary checkpoint.


@dataclass(frozen=True)
class QuantSource:
    """What the model folder holds that the plan depends on."""

    kind: str | None  # "prequantized" | "gguf" | None (an ordinary checkpoint)
    parameters: int  # elements of the traced checkpoint's floating-point tensors
    prequantized: Any = None  # a pre-quantised checkpoint's integers (prequantized.PrequantizedWeights)
    gguf_file: Path | None = None  # the GGUF a converted folder came from


def read_layout(model_dir: str | Path) -> Any:
    """A pre-quantised checkpoint's layout (refused in one line where kvforge does not take its format), None for any
    other input: read once per export, from config.json's quantization_config."""
    from kvforge.exporter.quantization.prequantized_convert import prequantized_layout

    if not (Path(model_dir) / "config.json").is_file():
        return None
    return prequantized_layout(Path(model_dir))


def prequantized_twin(model_dir: Path, layout: Any, hf_dir: Path, say: Callable[[str], None]) -> tuple[Path, Any]:
    """The dequantised twin the export traces (made in `hf_dir`, or reused) and the checkpoint's integers, read from
    its shards' headers once."""
    from kvforge.exporter.quantization.prequantized import PrequantizedWeights
    from kvforge.exporter.quantization.prequantized_convert import convert_prequantized
    from kvforge.models.checkpoint_names import refuse_doubled_layers

    weights = PrequantizedWeights(model_dir, layout)
    refuse_doubled_layers(model_dir, weights.prefixes, weights.files)  # before its twin is written
    folder = convert_prequantized(model_dir, hf_dir, say, weights)
    return Path(folder).resolve(), weights


def classify(checkpoint: Any, prequantized: Any, gguf_record: dict[str, Any] | None) -> QuantSource:
    """The source the plan is resolved on, from the checkpoint opened once (exporter/checkpoint.py)."""
    from kvforge.exporter.checkpoint import COMPUTE_DTYPES

    parameters = sum(math.prod(info.shape) for info in map(checkpoint.info, checkpoint.names)
                     if info.dtype in COMPUTE_DTYPES)
    if prequantized is not None:
        return QuantSource("prequantized", parameters, prequantized)
    if gguf_record is not None:
        return QuantSource("gguf", parameters, gguf_file=Path(gguf_record["source"]))
    return QuantSource(None, parameters)


def integer_weights(plan: Any, source: QuantSource, model_dir: Path, calibration: str | Path | None, work: Path,
                    clock: dict[str, float], say: Callable[[str], None]) -> Any:
    """The integers the plan carries over instead of rounding: a pre-quantised checkpoint's, a GGUF's blocks, or
    AutoRound's calibration (run now, into `work`); None where every weight is rounded or fitted here."""
    if plan.origin == "prequantized":
        return source.prequantized
    if plan.origin == "gguf":
        from kvforge.exporter.quantization.gguf_blocks import gguf_int_weights

        assert source.gguf_file is not None
        return gguf_int_weights(source.gguf_file, model_dir)
    if plan.origin == "autoround":
        from kvforge.exporter.quantization.autoround import calibrate

        began = time.perf_counter()
        weights = calibrate(model_dir, 4, plan.block_size, calibration, work, say)
        clock["calibrate"] = time.perf_counter() - began
        return weights
    return None


def check_options(options: Any, target: str) -> None:
    """Refuse quantisation options (ExportOptions) that cannot go together, or with `target`, in one line, before any
    work; --quant-method None is the default (chosen later, by _choose)."""
    _check_weights(options.quantize, options.block_size, options.dtype, options.lm_head_bits, options.quant_method,
                   options.accuracy_level)
    if options.calibration is not None and options.quant_method not in (None, "autoround"):
        raise InputError(f"--calibration goes with --quant-method autoround, not {options.quant_method}")
    if options.quant_method == "autoround" or options.calibration is not None:
        from kvforge.exporter.quantization.autoround import read_calibration

        read_calibration(options.calibration)  # an empty or binary file is said before any work
    bits = getattr(options, "draft_lm_head_bits", None)
    if bits is not None and bits not in DRAFT_LM_HEAD_BITS:
        raise InputError(f"--draft-lm-head-bits takes 4 or 8, not {bits}")
    if bits is not None and target != "ort":
        raise InputError(f"--draft-lm-head-bits goes with --target ort (ONNX Runtime's MatMulNBits), not {target}")


def _check_weights(quantize: str | None, block_size: int, dtype: str, lm_head_bits: int | None,
                   method: str | None, accuracy_level: int) -> None:
    if method is None:
        method = "rtn"  # what the default is checked as: it is hqq or autoround only where those take the options
    if method not in METHODS:
        raise InputError(f"--quant-method takes {', '.join(METHODS)}, not {method!r}")
    if isinstance(accuracy_level, bool) or accuracy_level not in ACCURACY_LEVELS:
        raise InputError(f"--accuracy-level takes {', '.join(f'{k} ({v})' for k, v in ACCURACY_LEVELS.items())}, "
                         f"not {accuracy_level!r}")
    if quantize is None:
        if lm_head_bits is not None:
            raise InputError("--lm-head-bits goes with --quantize")
        if accuracy_level != DEFAULT_ACCURACY_LEVEL:
            raise InputError("--accuracy-level goes with --quantize")
        if method != "rtn":
            raise InputError(f"--quant-method {method} goes with --quantize int4")
        return
    if method != "rtn" and quantize != "int4":
        raise InputError(f"--quant-method {method} takes --quantize int4 only (8-bit rounding already costs little): "
                         f"use --quantize {quantize} with --quant-method rtn")
    if lm_head_bits not in (None, 8, BITS.get(quantize)):
        raise InputError(f"--lm-head-bits takes 8 (or the --quantize bits), not {lm_head_bits}")
    if quantize not in BITS:
        raise InputError(f"--quantize takes {', '.join(BITS)}, not {quantize!r}")
    if block_size not in BLOCK_SIZES:
        raise InputError(f"--block-size takes {', '.join(map(str, BLOCK_SIZES))}, not {block_size}")
    if dtype != "fp32" and method == "hqq":
        raise InputError(f"--quant-method {method} runs with fp32 activations only; drop --dtype {dtype} "
                         "(--quant-method rtn takes fp16 and bf16 activations for ONNX Runtime CUDA)")


def with_checkpoint_bits(options: Any, layout: Any, model_dir: str | Path) -> Any:
    """A pre-quantised checkpoint's integers are carried over as they are: --quantize takes its bits (given or
    not); another width or method is refused, in one line. `layout`: its layout (prequantized.py), or None."""
    if layout is None:
        return options
    bits = f"int{layout.bits}"
    if options.quantize not in (None, bits) or options.quant_method not in (None, "rtn"):
        asked = f"--quantize {options.quantize}" if options.quantize not in (None, bits) else \
            f"--quant-method {options.quant_method}"
        raise InputError(f"{model_dir} is {layout.article} {layout.describe()} checkpoint: kvforge carries its integers "
                         f"over as they are, so {asked} does not apply; drop it")
    return dataclasses.replace(options, quantize=bits, quant_method="rtn")  # its integers: nothing to calibrate


@dataclass(frozen=True)
class QuantPlan:
    """What an export's weights become: `quantize` None is a float export (every other field then says nothing)."""

    quantize: str | None
    method: str  # rtn | hqq | autoround (rtn for a float export: nothing is rounded)
    method_why: str | None  # why, where it was the default (None: given)
    lm_head_bits: int | None  # 8 with int4: an 8-bit lm_head; None: as the other weights
    lm_head_why: str | None  # why, where it was the default
    block_size: int
    accuracy_level: int
    origin: str  # choices.ORIGINS: a pre-quantised checkpoint's or a GGUF's integers, or the method that makes them
    parameters: int  # the checkpoint's parameter count, which the defaults depend on
    draft_lm_head_bits: int | None = None  # a speculation head's lm_head as MatMulNBits (draft_lm_head.py)

    @property
    def bits(self) -> int | None:
        return BITS.get(self.quantize or "")

    @classmethod
    def resolve(cls, options: Any, source: Any) -> QuantPlan:
        """The plan for `options` (checked by ExportOptions.resolve) on `source` (source.py: the classified input)."""
        method, method_why, head, head_why = _choose(options, source.kind, source.parameters)
        if options.quantize is None:
            origin = "none"
        elif source.kind == "prequantized":
            origin = "prequantized"
        else:
            origin = "gguf" if source.kind == "gguf" and method == "rtn" else method
        return cls(options.quantize, method, method_why, head, head_why, options.block_size, options.accuracy_level,
                   origin, source.parameters, getattr(options, "draft_lm_head_bits", None))

    def apply(self, prefill: Any, model: Any, work: Any, layout: Any, lap: Callable[[str], None]) -> tuple[Any, Any]:
        """The prefill graph quantised as planned, and what the lowering and the manifest need (apply.py)."""
        from kvforge.exporter.quantization.apply import apply_plan

        return apply_plan(self, prefill, model, work, layout, lap)

    def apply_to_graph(self, graph: Any, vocab_size: int) -> tuple[Any, dict[str, Any]]:
        """Another graph's weight matrices rounded as planned (an encoder-decoder's encoder and decoder:
        exporter/encoder_decoder.py): the graph and its record."""
        from kvforge.exporter.quantization.matmuls import quantize_model

        return quantize_model(graph, self.quantize, self.block_size, vocab_size, self.accuracy_level,
                              self.lm_head_bits)

    def apply_to_draft(self, draft: Any, record: dict[str, Any]) -> None:
        """draft.onnx's lm_head as MatMulNBits where --draft-lm-head-bits asks (draft_lm_head.py); `record`: the
        manifest's draft record, which says so."""
        if self.draft_lm_head_bits is not None:
            from kvforge.exporter.quantization.draft_lm_head import quantize_lm_head

            quantize_lm_head(draft, self.draft_lm_head_bits, record)

    def record(self) -> dict[str, Any]:
        """The plan's part of the manifest's quantisation record (the passes add what they did)."""
        record: dict[str, Any] = {}
        if self.lm_head_why:
            record["lm_head_bits_default"] = self.lm_head_why
        if self.method_why:
            record["quant_method_default"] = self.method_why
        record["parameters"] = self.parameters
        return record


def _choose(options: Any, kind: str | None, parameters: int) -> tuple[str | None, str | None, int | None, str | None]:
    """The int4 method and the lm_head's bits, given or chosen for this model, each with why where chosen (the one
    place both defaults are decided). int4 under 1B parameters is fitted with HQQ, its float zero points run beside
    the integer kernel (float_offsets.py): on the real SmolLM2-135M-Instruct it keeps perplexity within 0.3% of
    fp32 and 94 of 96 greedy tokens, where AutoRound's calibration (integer zero points) keeps +6.1% and 81 and
    round-to-nearest +13.3% and 69, in seconds, for 0.78x round-to-nearest's decode speed (docs/quantisation.md).
    HQQ takes fp32 activations only: there AutoRound. From 1B the whole model would have to be held (HQQ) or
    calibrated for hours (AutoRound); a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks are its model and are carried over as they
    are. The lm_head stays at 8 bits under 1B (SMALL_MODEL_PARAMETERS), except where a pre-quantised checkpoint's
    float lm_head is kept as it has it."""
    quantize, method, why = options.quantize, options.quant_method, None
    if method is None and options.calibration is not None:
        method = "autoround"  # a calibration text asks for calibration
    elif method is None and quantize != "int4":
        method = "rtn"
    elif method is None and kind == "gguf":
        method, why = "rtn", ("rtn: a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks are carried over as they are and the rest "
                              "rounded (--quant-method hqq fits the rest instead)")
    elif method is None and parameters >= SMALL_MODEL_PARAMETERS:
        method, why = "rtn", (f"rtn: the default from 1B parameters ({parameters / 1e9:.1f}B here: HQQ holds the whole "
                              "model, calibrating would take hours on a CPU; --quant-method hqq or autoround anyway)")
    elif method is None and options.dtype != "fp32":
        method, why = "autoround", (f"autoround: calibrated int4, the default under 1B parameters with --dtype "
                                    f"{options.dtype} (HQQ runs with fp32 activations only; minutes of calibration on a "
                                    "CPU, --quant-method rtn rounds in seconds)")
    elif method is None:
        method, why = "hqq", ("hqq: int4 fitted with HQQ, the default under 1B parameters (closest to fp32 of the "
                              "methods, in seconds; --quant-method rtn decodes faster)")
    head, head_why = options.lm_head_bits, None
    if quantize == "int4" and head is None and kind != "prequantized" and parameters < SMALL_MODEL_PARAMETERS:
        head, head_why = 8, (f"lm_head at 8 bits: the default for models under 1B parameters (this one has "
                             f"{parameters / 1e6:.0f}M; --lm-head-bits 4 for all-4-bit)")
    return method, why, head, head_why
