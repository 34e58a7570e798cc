"""kvforge.runtime.backends: the backends: the protocol and registry, the KV cache, ONNX Runtime, TensorRT and the CPU emulation."""
