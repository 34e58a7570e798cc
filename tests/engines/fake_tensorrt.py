"""A stand-in for the parts of `tensorrt.plugin` (QDP) that kvforge's plugin uses, following TensorRT's
documented API: registration by decorators whose annotations must be live types, tensor descriptors
with shape expressions, `like()` / `aliased()`, `cdiv`, `SymInt32`, `SymIntExprs`, `KernelLaunchParams`.

Shape expressions here carry concrete values (and whether TensorRT would know them at build time), so
the ahead-of-time function's grid and scalar arguments can be evaluated and launched for real.
TensorRT itself cannot be installed on these machines; this is how the code up to its API is tested.

Registration follows tensorrt/plugin/_lib.py (NVIDIA/TensorRT, python/packaging/bindings_wheel): each
`install()` is a fresh TensorRT with its own registry, like a fresh process. `register` defines the plugin
as `tensorrt.plugin.op.<namespace>.<name>` and raises ValueError when that is already defined (the real
one's check), and, not being lazy, adds a creator to `tensorrt.get_plugin_registry()` (looked up with
`get_creator(name, "1", namespace)`, None when absent).
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


_ATTR_TYPES = (int, float, str, bool, bytes)
# The installed fake's plugin definitions by id (tensorrt.plugin's QDP_REGISTRY); install() replaces it.
REGISTRY: dict[str, dict] = {}


class PluginCreator:
    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.plugin_namespace, self.plugin_version = name, namespace, "1"


class PluginRegistry:
    """TensorRT's plugin registry (trt.get_plugin_registry()): creators by (name, version, namespace)."""

    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], PluginCreator] = {}

    def register_creator(self, creator: PluginCreator, namespace: str = "") -> bool:
        key = (creator.name, creator.plugin_version, namespace)
        if key in self.creators:
            return False  # like TensorRT: False if one with the same name is already registered
        self.creators[key] = creator
        return True

    def get_creator(self, name: str, version: str, namespace: str = "") -> PluginCreator | None:
        return self.creators.get((name, version, namespace))


class _Namespace(types.SimpleNamespace):
    """tensorrt.plugin.op and its per-namespace objects: a missing name raises AttributeError."""


def _plugin_api(plugins: dict[str, dict], op: _Namespace, registry: PluginRegistry) -> tuple:
    """register and aot_impl bound to one installed TensorRT's registries."""

    def register(plugin_id: str, lazy_register: bool = False):
        def decorator(fn):
            namespace, name = plugin_id.split("::")
            ns = getattr(op, namespace, None)
            if ns is None:
                ns = _Namespace()
                setattr(op, namespace, ns)
            if hasattr(ns, name):
                raise ValueError(f"'_Op' already has a definition for '{name}'")
            sig = inspect.signature(fn)
            seen_attr = False
            tensors, attrs = [], []
            for arg, param in sig.parameters.items():
                ann = param.annotation
                assert ann is not inspect.Parameter.empty, f"{arg} has no annotation"
                assert not isinstance(ann, str), f"{arg}'s annotation is a string: tensorrt.plugin needs live types"
                if ann is TensorDesc:
                    assert not seen_attr, "tensor descriptors must come before attributes"
                    tensors.append(arg)
                else:
                    assert ann in _ATTR_TYPES, f"{arg}: {ann} is not a serializable attribute type"
                    seen_attr = True
                    attrs.append(arg)
            plugins[plugin_id] = {"describe": fn, "tensors": tensors, "attrs": attrs}
            if not lazy_register:
                registry.register_creator(PluginCreator(name, namespace), namespace)
            setattr(ns, name, plugins[plugin_id])
            return fn

        return decorator

    def aot_impl(plugin_id: str):
        def decorator(fn):
            if plugin_id not in plugins:
                raise ValueError(f"Plugin {plugin_id} is not registered. Did you register it with tensorrt.plugin.register API?")
            entry = plugins[plugin_id]
            sig = inspect.signature(fn)
            assert list(sig.parameters) == entry["tensors"] + entry["attrs"] + ["outputs", "tactic"], sig
            ret = sig.return_annotation
            assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == 4, ret
            args = typing.get_args(ret)
            assert issubclass(args[2], KernelLaunchParams) and issubclass(args[3], SymExprs)
            entry["aot"] = fn
            return fn

        return decorator

    return register, aot_impl


def install() -> types.ModuleType:
    """Put fresh `tensorrt` and `tensorrt.plugin` stand-ins into sys.modules (empty registries, as in a
    new process); returns the plugin module."""
    global REGISTRY
    REGISTRY = {}
    registry = PluginRegistry()
    trt = types.ModuleType("tensorrt")
    trt.DataType = DataType
    trt.get_plugin_registry = lambda: registry
    plugin = types.ModuleType("tensorrt.plugin")
    for name in ("TensorDesc", "cdiv", "SymInt32", "SymExprs", "SymIntExprs", "KernelLaunchParams"):
        setattr(plugin, name, globals()[name])
    plugin.op = _Namespace()
    plugin.register, plugin.aot_impl = _plugin_api(REGISTRY, plugin.op, registry)
    trt.plugin = plugin
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, plugin
    return plugin


def run_aot(plugin_id: str, inputs: list[TensorDesc], attrs: dict) -> tuple:
    """Call the registered description and ahead-of-time functions as TensorRT would at build time."""
    entry = REGISTRY[plugin_id]
    outputs = entry["describe"](*inputs, **attrs)
    return outputs, entry["aot"](*inputs, **attrs, outputs=outputs, tactic=0)
