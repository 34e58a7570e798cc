"""A stand-in for the parts of `tensorrt.plugin` (QDP) that kvforge's plugin uses, following TensorRT's
documented API: registration by decorators whose annotations must be live types, tensor descriptors
with shape expressions, `like()` / `aliased()`, `cdiv`, `SymInt32`, `SymIntExprs`, `KernelLaunchParams`.

Shape expressions here carry concrete values (and whether TensorRT would know them at build time), so
the ahead-of-time function's grid and scalar arguments can be evaluated and launched for real.
TensorRT itself cannot be installed on these machines; this is how the code up to its API is tested.
"""

from __future__ import annotations

import enum
import inspect
import math
import sys
import types
import typing


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BF16 = 7


class Expr:
    """A shape or integer expression: a value, and whether it is a build-time constant."""

    def __init__(self, value: int, constant: bool = True) -> None:
        self.value, self.is_constant = int(value), constant

    def _op(self, other, fn) -> Expr:
        other = other if isinstance(other, Expr) else Expr(other)
        return Expr(fn(self.value, other.value), self.is_constant and other.is_constant)

    def __add__(self, other):
        return self._op(other, lambda a, b: a + b)

    def __mul__(self, other):
        return self._op(other, lambda a, b: a * b)

    def __floordiv__(self, other):
        return self._op(other, lambda a, b: a // b)

    def constant_value(self) -> int:
        if not self.is_constant:
            raise RuntimeError("not a build-time constant")
        return self.value


class TensorDesc:
    def __init__(self, shape: list[Expr], dtype: DataType) -> None:
        self.shape_expr, self.dtype, self.aliased_to = shape, dtype, None

    def like(self) -> TensorDesc:
        return TensorDesc(list(self.shape_expr), self.dtype)

    def aliased(self) -> TensorDesc:
        clone = self.like()
        clone.aliased_to = self
        return clone


def cdiv(a, b) -> Expr:
    a, b = (x if isinstance(x, Expr) else Expr(x) for x in (a, b))
    return Expr(math.ceil(a.value / b.value), a.is_constant and b.is_constant)


class SymInt32(Expr):
    def __init__(self, value) -> None:
        super().__init__(value.value if isinstance(value, Expr) else value,
                         value.is_constant if isinstance(value, Expr) else True)


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    def __init__(self, n: int) -> None:
        super().__init__([None] * n)


class KernelLaunchParams:
    def __init__(self) -> None:
        self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


REGISTRY: dict[str, dict] = {}
_ATTR_TYPES = (int, float, str, bool, bytes)


def register(plugin_id: str):
    def decorator(fn):
        sig = inspect.signature(fn)
        seen_attr = False
        tensors, attrs = [], []
        for name, param in sig.parameters.items():
            ann = param.annotation
            assert ann is not inspect.Parameter.empty, f"{name} has no annotation"
            assert not isinstance(ann, str), f"{name}'s annotation is a string: tensorrt.plugin needs live types"
            if ann is TensorDesc:
                assert not seen_attr, "tensor descriptors must come before attributes"
                tensors.append(name)
            else:
                assert ann in _ATTR_TYPES, f"{name}: {ann} is not a serializable attribute type"
                seen_attr = True
                attrs.append(name)
        REGISTRY[plugin_id] = {"describe": fn, "tensors": tensors, "attrs": attrs}
        return fn

    return decorator


def aot_impl(plugin_id: str):
    def decorator(fn):
        entry = REGISTRY[plugin_id]
        sig = inspect.signature(fn)
        assert list(sig.parameters) == entry["tensors"] + entry["attrs"] + ["outputs", "tactic"], sig
        ret = sig.return_annotation
        assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == 4, ret
        args = typing.get_args(ret)
        assert issubclass(args[2], KernelLaunchParams) and issubclass(args[3], SymExprs)
        entry["aot"] = fn
        return fn

    return decorator


def install() -> types.ModuleType:
    """Put `tensorrt` and `tensorrt.plugin` stand-ins into sys.modules; returns the plugin module."""
    trt = types.ModuleType("tensorrt")
    trt.DataType = DataType
    plugin = types.ModuleType("tensorrt.plugin")
    for name in ("TensorDesc", "cdiv", "SymInt32", "SymExprs", "SymIntExprs", "KernelLaunchParams",
                 "register", "aot_impl"):
        setattr(plugin, name, globals()[name])
    trt.plugin = plugin
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, plugin
    REGISTRY.clear()
    return plugin


def run_aot(plugin_id: str, inputs: list[TensorDesc], attrs: dict) -> tuple:
    """Call the registered description and ahead-of-time functions as TensorRT would at build time."""
    entry = REGISTRY[plugin_id]
    outputs = entry["describe"](*inputs, **attrs)
    return outputs, entry["aot"](*inputs, **attrs, outputs=outputs, tactic=0)
