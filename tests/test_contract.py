"""The contracts are defined once (kvforge/contract.py, kvforge/targets.py): no other source file
spells a graph IO name, the KV layout's cache names or the plugin identity, and the registries hold
what the rest of kvforge asks of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvforge import contract
from kvforge.contract import PLUGIN, GraphIO, KVLayout, capacity_buckets
from kvforge.errors import InputError, ManifestError
from kvforge.targets import TARGETS, get_target

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("kvforge", "exporter", "runtime", "plugins", "models") for p in sorted((ROOT / folder).glob("*.py"))]
DEFINITIONS = {ROOT / "kvforge" / "contract.py"}
IO_NAMES = {contract.INPUT_IDS, contract.PAST_LENS, contract.LOGITS_INDEX, contract.LOGITS, contract.LOGITS_POSITIONS}
CACHE_NAME = re.compile(r"(past|present)_(key|value)\.")
PLUGIN_STRINGS = {PLUGIN.name, PLUGIN.onnx_domain, PLUGIN.id, "plugin_namespace", "plugin_version"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function): prose, not code."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]


def test_graph_io_names_and_plugin_identity_are_spelled_only_in_the_contract() -> None:
    assert len(SOURCES) > 40  # the scan sees the whole package
    found = []
    for path in SOURCES:
        if path in DEFINITIONS:
            continue
        for line, text in _literals(path):
            if text in IO_NAMES or CACHE_NAME.search(text) or text in PLUGIN_STRINGS:
                found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not found, "contract names written outside kvforge/contract.py:\n" + "\n".join(found)


def test_the_scan_finds_a_name_written_twice(tmp_path) -> None:
    # The check above can fail: a module spelling an IO name is caught, in f-strings too.
    bad = tmp_path / "bad.py"
    bad.write_text('"""past_key.0 in a docstring is prose."""\nNAMES = ["input_ids", f"past_value.{3}"]\n')
    texts = [text for _, text in _literals(bad)]
    assert "input_ids" in texts and any(CACHE_NAME.search(t) for t in texts)
    assert not any("docstring" in t for t in texts)


def test_graph_io_follows_the_kv_layout() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", max_capacity=128)
    prefill, decode = GraphIO.of("prefill", layout), GraphIO.of("decode", layout)
    assert prefill.inputs == ("input_ids", "past_lens", "logits_index",
                              "past_key.0", "past_value.0", "past_key.1", "past_value.1")
    assert decode.inputs == tuple(n for n in prefill.inputs if n != "logits_index")
    assert prefill.outputs == decode.outputs == ("logits", "present_key.0", "present_value.0",
                                                  "present_key.1", "present_value.1")
    assert layout.bytes(3, 64) == 2 * 2 * 3 * 2 * 64 * 16 * 2
    assert KVLayout.from_manifest({"kv_cache": layout.to_manifest()}) == layout
    with pytest.raises(ManifestError, match="kv_cache.head_dim must be a positive integer"):
        KVLayout.from_manifest({"kv_cache": {**layout.to_manifest(), "head_dim": "16"}})
    with pytest.raises(ManifestError, match="does not follow the KV cache contract"):
        prefill.check(list(decode.inputs), list(decode.outputs), "here")
    assert capacity_buckets(300) == (64, 128, 256, 300)


def test_the_plugin_identity_is_what_built_engines_ask_for() -> None:
    # Pinned here: engines built earlier and TensorRT's parser find the plugin by exactly these.
    assert (PLUGIN.name, PLUGIN.namespace, PLUGIN.version, PLUGIN.onnx_domain) == (
        "KVCacheAttention", "kvforge", "1", "ai.onnx.contrib")
    assert PLUGIN.id == "kvforge::KVCacheAttention"
    assert PLUGIN.node_attributes() == {"plugin_namespace": "kvforge", "plugin_version": "1"}
    assert (contract.CANONICAL_OP.domain, contract.CANONICAL_OP.op_type) == ("kvforge", "KVCacheAttention")


def test_target_registry() -> None:
    assert set(TARGETS) == {"ort", "onnx", "trt"}
    assert [t.name for t in TARGETS.values() if t.buildable] == ["onnx", "trt"]
    assert get_target("trt").plugin is PLUGIN and get_target("ort").plugin is None
    with pytest.raises(InputError, match="unknown target 'tensorrt'; choose one of ort, onnx, trt"):
        get_target("tensorrt")


def test_every_target_names_a_lowering_pass_that_exists() -> None:
    pytest.importorskip("onnx_ir")
    import importlib

    for target in TARGETS.values():
        module, name = target.lowering.split(":")
        assert callable(getattr(importlib.import_module(module), name)), target.name


def test_backend_and_target_names_never_meet() -> None:
    from kvforge.runtime.backend import REGISTRY, create_backend

    assert not set(REGISTRY) & set(TARGETS)
    for target in TARGETS.values():
        assert target.name in REGISTRY[target.default_backend].targets
    with pytest.raises(InputError, match="backend 'trt' is now called 'tensorrt'"):
        create_backend("trt", "nowhere", {"target": "trt"})


def test_layering_no_module_imports_upward() -> None:
    """kvforge's base modules (errors, contract, targets, manifest, output folders, engine plan) import
    no other layer; the exporter never imports the runtime or the apps; the runtime never imports the
    exporter or the apps."""
    base = {"errors", "contract", "targets", "manifest", "external_data", "output_folder", "engine_plan",
            "tensorrt_flavor", "progress", "__init__"}
    apps = {"cli", "server", "serve_ray", "bench", "demo", "parity", "inspect", "coverage_sweep"}
    allowed = {
        "base": {"kvforge"},
        "exporter": {"kvforge", "exporter", "models", "plugins"},
        "runtime": {"kvforge", "runtime", "plugins"},
        "plugins": {"kvforge", "plugins"},
        "models": {"kvforge", "models"},
    }
    wrong = []
    for path in SOURCES:
        folder = path.parent.name
        layer = ("base" if path.stem in base else "apps") if folder == "kvforge" else folder
        if layer == "apps":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvforge"):
                parts = node.module.split(".")
                if len(parts) == 1:  # `from kvforge import x`: x is a module of the base or an app
                    names = [alias.name for alias in node.names]
                    if any(name in apps for name in names) or (layer == "base" and any(n not in base and n != "__version__" for n in names)):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {names} from kvforge")
                    continue
                into = parts[1]
                if into in apps or (into not in allowed[layer] and not (into in base and len(parts) == 2)):
                    if not (layer != "base" and into in base):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
