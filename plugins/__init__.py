"""kvforge.plugins: the fused attention op (torch reference, Triton kernel, AOT PTX, lowerings).

`compile_ptx` / `compile_kernel` / `compile_kernels` / `KernelVariant` are resolved lazily: importing kvforge.plugins
imports neither triton nor torch, and plugins.ptx imports triton only when it has to compile.
"""

from __future__ import annotations

_LAZY = {name: "kvforge.plugins.ptx" for name in ("compile_ptx", "compile_kernel", "compile_kernels", "KernelVariant")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvforge.plugins' has no attribute {name!r}")
