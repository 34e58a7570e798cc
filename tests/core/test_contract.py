"""The contracts are defined once (kvforge/core/contract.py, kvforge/core/targets.py): no other source file
spells a graph IO name, the KV layout's cache names or the plugin identity, and the registries hold
what the rest of kvforge asks of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvforge.core import contract
from kvforge.core.contract import PLUGIN, GraphIO, KVLayout, capacity_buckets
from kvforge.core.errors import InputError, ManifestError
from kvforge.core.targets import TARGETS, get_target

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("kvforge", "exporter", "runtime", "plugins", "models") for p in sorted((ROOT / folder).rglob("*.py"))]
DEFINITIONS = {ROOT / "kvforge" / "core" / "contract.py"}
IO_NAMES = {contract.INPUT_IDS, contract.PAST_LENS, contract.LOGITS_INDEX, contract.LOGITS, contract.LOGITS_POSITIONS,
            contract.IMAGE_FEATURES, contract.PIXEL_VALUES}
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
    assert not found, "contract names written outside kvforge/core/contract.py:\n" + "\n".join(found)


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


def test_every_target_has_its_exporter_module() -> None:
    pytest.importorskip("onnx_ir")
    from kvforge.exporter.targets import EXPORT_TARGETS

    assert list(EXPORT_TARGETS) == list(TARGETS)
    for name, passes in EXPORT_TARGETS.items():
        assert passes.name == name and callable(passes.lower_attention) and callable(passes.lower_moe)


def test_backend_and_target_names_never_meet() -> None:
    from kvforge.runtime.backends.backend import REGISTRY, create_backend

    assert not set(REGISTRY) & set(TARGETS)
    for target in TARGETS.values():
        assert target.name in REGISTRY[target.default_backend].targets
    with pytest.raises(InputError, match="backend 'trt' is now called 'tensorrt'"):
        create_backend("trt", "nowhere", {"target": "trt"})


# The layers, by folder: what each may import besides itself and the package face (kvforge/__init__.py).
# A module is in the layer of its folder, so a new module is checked without being listed anywhere.
LAYERS = {
    "core": set(),
    "models": {"core"},
    "plugins": {"core"},
    "exporter": {"core", "models", "plugins"},
    "runtime": {"core", "plugins"},
    "engines": {"core", "plugins"},
    "tools": {"core", "models", "plugins", "exporter", "runtime", "engines"},
    "serve": {"core", "runtime"},
    "cli": {"core", "models", "plugins", "exporter", "runtime", "engines", "tools", "serve"},
}
FOLDERS = {"core": "kvforge/core", "engines": "kvforge/engines", "cli": "kvforge/cli", "serve": "kvforge/serve",
           "tools": "kvforge/tools", "exporter": "exporter", "runtime": "runtime", "plugins": "plugins", "models": "models"}
MODULE_STRING = re.compile(r"kvforge(\.\w+)+(:\w+)?")


def imported_layers(source: str) -> list[tuple[int, str, str]]:
    """(line, module, layer) of every kvforge module `source` imports, in any scope: `import`, `from ...
    import` (names imported from a package are its modules), and the strings importlib is given
    (an import_module / __import__ argument, or a registry's "module:name")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            modules = [str(node.args[0].value)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value and \
                MODULE_STRING.fullmatch(node.value):
            modules = [node.value.split(":")[0]]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "kvforge" and len(parts) > 1 and parts[1] in LAYERS:
                found.append((node.lineno, module, parts[1]))
    return found


def layering_violations(layer: str, source: str, where: str = "") -> list[str]:
    return [f"{where}:{line} ({layer}) imports {module}" for line, module, into in imported_layers(source)
            if into != layer and into not in LAYERS[layer]]


def test_layering_no_module_imports_upward() -> None:
    """Every module sits in a layer folder, and imports only its own layer and the ones LAYERS lists
    below it: the exporter never the runtime, the runtime never the exporter, nothing the apps."""
    loose = [p.name for p in (ROOT / "kvforge").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layer folders: {loose}"
    folders = {p.name for p in (ROOT / "kvforge").iterdir() if p.is_dir() and p.name not in ("data", "__pycache__")}
    assert folders == {folder.split("/")[1] for folder in FOLDERS.values() if folder.startswith("kvforge/")}
    assert imported_layers((ROOT / "kvforge" / "__init__.py").read_text()) == []
    wrong = []
    for layer, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            wrong += layering_violations(layer, path.read_text(), str(path.relative_to(ROOT)))
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("layer", "source"), [
    ("core", "import kvforge.runtime.drivers.generator"),  # a plain import
    ("runtime", "from kvforge import exporter"),  # a layer's package taken from kvforge's face
    ("exporter", "def later():\n    from kvforge.runtime.drivers.generator import Generator\n"),  # inside a function
    ("core", "import importlib\nimportlib.import_module('kvforge.exporter.lowering')"),  # importlib
    ("core", "LOWERING = 'kvforge.exporter.lowering:lower_to_ort'"),  # a registry's importlib string
    ("serve", "from kvforge.tools.bench import run_bench"),  # an app folder no list names
])
def test_the_layering_check_sees_every_kind_of_upward_import(layer, source) -> None:
    # Each kind the old check missed: only `from` imports, names taken from `kvforge`, modules that no
    # hand list named, and importlib strings.
    assert layering_violations(layer, source), source
    assert not layering_violations(layer, "from kvforge.core.errors import InputError\nimport numpy")


def test_every_written_out_attention_op_is_checked_at_import() -> None:
    # Each implementation that spells the op's parameters out calls check_attention_parameters at import.
    root = Path(__file__).resolve().parents[2]
    sites = {path.relative_to(root).as_posix() for folder in ("plugins", "runtime")
             for path in (root / folder).rglob("*.py") if "check_attention_parameters(" in path.read_text()}
    assert sites == {"plugins/torch_op.py", "plugins/trt_plugin.py", "plugins/reference.py",
                     "plugins/numpy_reference.py", "plugins/triton_attention.py", "runtime/backends/emulate.py"}


def test_an_attention_op_out_of_contract_order_is_refused() -> None:
    def swapped(q, k, v, past_value, past_key, past_lens, attrs, *, interpret=None):
        return q

    def in_order(q, k, v, past_key, past_value, past_lens, attrs, *, interpret=None):
        return q

    contract.check_attention_parameters(in_order, contract.attention_parameters(spelled=False))
    with pytest.raises(RuntimeError, match=r"swapped takes .*'past_value', 'past_key'.* contract is"):
        contract.check_attention_parameters(swapped, contract.attention_parameters(spelled=False))
    spelled = contract.attention_parameters(sinks=True)
    optional = ("sinks", "alibi_slopes", "block_ids", "attention_bias")
    assert spelled == contract.ATTENTION_INPUTS + optional + contract.AttentionAttrs.names()


# Inside the runtime, by role folder (runtime/<role>/): what each may import of the runtime besides itself. The
# package face and runtime/service.py (the server's side, above them all) are imported by none of them.
RUNTIME_ROLES = {"text": set(), "media": set(), "controls": {"text"}, "backends": set(),
                 "drivers": {"backends", "controls", "media", "text"}}


def runtime_role_violations(role: str, source: str, where: str = "") -> list[str]:
    wrong = []
    for line, module, layer in imported_layers(source):
        parts = module.split(".")
        into = parts[2] if layer == "runtime" and len(parts) > 2 else role
        if into != role and into not in RUNTIME_ROLES[role]:
            wrong.append(f"{where}:{line} (runtime/{role}) imports {module}")
    return wrong


def test_the_runtime_roles_import_only_downward() -> None:
    """Backends never import the drivers (or controls or text), text never imports backends (or anything else of the
    runtime), controls only text; only __init__.py and service.py sit in runtime/ itself."""
    runtime = ROOT / "runtime"
    assert sorted(p.name for p in runtime.glob("*.py")) == ["__init__.py", "service.py"]
    assert {p.name for p in runtime.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(RUNTIME_ROLES)
    wrong = []
    for role in RUNTIME_ROLES:
        for path in sorted((runtime / role).rglob("*.py")):
            wrong += runtime_role_violations(role, path.read_text(), str(path.relative_to(ROOT)))
    assert not wrong, "imports against the runtime's roles:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("role", "source"), [
    ("backends", "from kvforge.runtime.drivers.scheduler import Scheduler"),  # a backend reaching for a driver
    ("backends", "from kvforge.runtime.controls.sampling import SamplingConfig"),
    ("text", "from kvforge.runtime.backends.backend import create_backend"),  # text reaching for a backend
    ("text", "from kvforge.runtime.controls.request import GenerationRequest"),
    ("controls", "import kvforge.runtime.drivers.engine"),
    ("drivers", "from kvforge.runtime.service import GenerationService"),  # the service sits above the drivers
    ("drivers", "from kvforge.runtime import Generator"),  # the package face, from inside
])
def test_the_runtime_role_check_sees_each_rule(role: str, source: str) -> None:
    assert runtime_role_violations(role, source), source
    assert not runtime_role_violations(role, "from kvforge.core.errors import InputError\nimport numpy")
