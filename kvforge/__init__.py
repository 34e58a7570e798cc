"""kvforge: Hugging Face causal LM -> prefill/decode graphs with fused attention -> fast runtime."""

__version__ = "0.1.0"
