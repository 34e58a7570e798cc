"""kvforge runtime: run an export folder (prefill + decode over an in-place KV cache).

Stands alone: imports neither torch, transformers nor onnx (only numpy, onnxruntime, tokenizers).
"""

from kvforge.runtime.decode_loop import GenerationResult, GenerationStream, StepEvent
from kvforge.runtime.generator import Generator
from kvforge.runtime.request import FinishReason, GenerationRequest, Speculation
from kvforge.runtime.sampling import SamplingConfig

__all__ = ["FinishReason", "GenerationRequest", "GenerationResult", "GenerationStream", "Generator", "SamplingConfig",
           "Speculation", "StepEvent"]
