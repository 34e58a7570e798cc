"""kvforge.plugins: the fused attention op (torch reference, Triton kernel, AOT PTX, lowerings).

`compile_ptx` / `compile_kernel` are resolved lazily: importing kvforge.plugins imports neither triton
nor torch, and plugins.ptx imports triton only when it has to compile.
"""

from __future__ import annotations

_LAZY = {"compile_ptx": "kvforge.plugins.ptx", "compile_kernel": "kvforge.plugins.ptx"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvforge.plugins' has no attribute {name!r}")
