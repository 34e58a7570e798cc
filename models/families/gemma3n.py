"""Gemma 3n's activation sparsity at export: the MLPs of its first layers keep only the gate activations
above mean + std * z, where z is the standard normal's quantile of the layer's target sparsity (0.95 in
E2B/E4B). HF computes z on every call with `Normal(0, 1).icdf`, whose erfinv has no ONNX form
(torch.onnx: "No ONNX function found for prims.erf_inv"). z depends only on the config, so it is
computed here once, in Python, and the graph gets a constant."""

from __future__ import annotations

import statistics
import struct
import types
from typing import Any

from kvforge.models.families.family import Family
from kvforge.models.families.surgery import Patches

SPARSITY = "activation sparsity's normal quantile computed once at export (erfinv has no ONNX form)"


def _gaussian_topk(self: Any, inputs: Any) -> Any:
    """HF's Gemma3nTextMLP._gaussian_topk with its quantile a constant (`self._kvforge_z`)."""
    import torch

    # In the activations' dtype, as HF casts its own (a bf16 export's cutoff is HF's bf16 one).
    z = torch.tensor(self._kvforge_z, dtype=torch.float32, device=inputs.device).type(inputs.dtype)
    mean = torch.mean(inputs, dim=-1, keepdim=True)
    std = torch.std(inputs, dim=-1, keepdim=True, unbiased=False)
    return torch.nn.functional.relu(inputs - (mean + std * z))


def adapt(model: Any, patches: Patches) -> str:
    """Each sparse MLP's quantile, computed once (float32, as HF casts its own) and used by its top-k."""
    sparse = 0
    for module in model.modules():
        sparsity = getattr(module, "activation_sparsity", 0.0)
        if type(module).__name__ == "Gemma3nTextMLP" and sparsity > 0.0:
            # Rounded to float32 (HF's icdf runs in float32) in plain Python: a streamed export runs this under
            # torch's fake-tensor mode, where a tensor has no value to read.
            z = statistics.NormalDist().inv_cdf(sparsity)
            patches.set(module, "_kvforge_z", struct.unpack("f", struct.pack("f", z))[0])
            patches.set(module, "_gaussian_topk", types.MethodType(_gaussian_topk, module))
            sparse += 1
    return f"{SPARSITY} ({sparse} layers)" if sparse else "no sparse layers"


# It changes code, never a weight: a streamed export (lazy_weights.streaming_refusal) may run it on fake weights.
FAMILIES = (Family("gemma3n_text", (), "activation sparsity's quantile a constant", patch=adapt,
                   patch_keeps_weights=True),)
