"""kvforge runtime: run an export folder (prefill + decode over an in-place KV cache).

Stands alone: imports neither torch, transformers nor onnx (only numpy, onnxruntime, tokenizers).
"""

from kvforge.runtime.generator import GenerationResult, GenerationStream, Generator, StepEvent
from kvforge.runtime.sampling import SamplingConfig

__all__ = ["GenerationResult", "GenerationStream", "Generator", "SamplingConfig", "StepEvent"]
