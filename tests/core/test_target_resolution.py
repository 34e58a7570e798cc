"""An export's target is resolved from its manifest once, where the manifest is read (LoadedExport's load, and the
few places that read one fresh from disk); everything after asks the resolved Target. Also: the exporter's target
base never imports the registry it is part of, and a family's `states` hook is what the exporter calls.

Scanned with ast, so a `get_target(` in a comment or docstring is not a call."""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("kvforge", "exporter", "runtime", "plugins", "models") for p in sorted((ROOT / folder).rglob("*.py"))]

# (file, enclosing function): how many get_target() calls it makes. Each reads a manifest no LoadedExport holds.
ALLOWED = Counter({
    # The runtime's load of an export folder: LoadedExport.target, which the backend, heads and drivers ask.
    ("runtime/drivers/loaded_export.py", "LoadedExport.__init__"): 1,
    # A backend or head built straight from a manifest dict with no target handed in (create_backend's documented
    # form, tests, benchmarks); a LoadedExport always hands its own.
    ("runtime/backends/backend.py", "export_target"): 1,
    # The backend options for a speculating export, read from its manifest on disk before the export is loaded.
    ("runtime/drivers/speculation_checks.py", "target_options"): 1,
    # `kvforge bench` checks its options against the manifest in the parent process; the workers load the export.
    ("kvforge/tools/bench.py", "_checked"): 1,
    # `kvforge build` reads the manifest from disk (no runtime load) and hands the target to engine_plan.
    ("kvforge/engines/trt_build.py", "build_engines"): 1,
})


def get_target_calls(source: str) -> Counter:
    """{enclosing function's qualified name ("" at module level): get_target() calls in it} of `source`."""
    found: Counter = Counter()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name == "get_target":
                    found[".".join(scope)] += 1
            visit(child, scope)

    visit(ast.parse(source), ())
    return found


def scan(sources: dict[str, str]) -> Counter:
    """{(file, function): get_target() calls} over `sources` ({relative path: text})."""
    return Counter({(path, where): n for path, text in sources.items() for where, n in get_target_calls(text).items()})


def test_the_target_is_resolved_only_where_a_manifest_is_read() -> None:
    found = scan({str(p.relative_to(ROOT)): p.read_text() for p in SOURCES})
    assert found == ALLOWED, f"get_target() outside the manifest-reading sites: {sorted((found - ALLOWED).elements())}"


def test_the_scan_catches_another_call_and_ignores_prose() -> None:
    sources = {path: (ROOT / path).read_text() for path, _ in ALLOWED}
    assert scan(sources) == ALLOWED
    extra = dict(sources)
    extra["runtime/backends/backend.py"] += (
        "\n\ndef again(manifest):\n    '''get_target(manifest['target']) in a docstring is prose'''\n"
        "    # get_target(manifest['target']) in a comment too\n    return targets.get_target(manifest['target'])\n")
    assert scan(extra) - ALLOWED == Counter({("runtime/backends/backend.py", "again"): 1})
    moved = dict(sources)  # a second call at an allowed site is caught as well
    moved["kvforge/tools/bench.py"] += "\n\ndef _checked(manifest):\n    return get_target(manifest['target'])\n"
    assert scan(moved) != ALLOWED


@pytest.mark.parametrize(("target", "default"), [("ort", "ort-cpu"), ("onnx", "ort-cpu"), ("trt", "emulate")])
def test_loaded_export_resolves_once_and_hands_its_target_on(tmp_path, monkeypatch, target, default) -> None:
    """One resolution per load: the default backend and the backend itself get the LoadedExport's Target."""
    from fake_backend import FakeBackend, write_export

    from kvforge.core.targets import TARGETS
    from kvforge.runtime.drivers import loaded_export

    folder = write_export(tmp_path / "export", target=target)
    resolved: list[str] = []
    created: list[tuple[str, object]] = []

    def counting(name: str):
        resolved.append(name)
        return TARGETS[name]

    def create(name, _folder, manifest, *, target=None, **options):
        created.append((name, target))
        return FakeBackend(manifest)

    monkeypatch.setattr(loaded_export, "get_target", counting)
    monkeypatch.setattr(loaded_export, "create_backend", create)
    export = loaded_export.LoadedExport(folder)
    assert resolved == [target] and export.target is TARGETS[target]
    assert created == [(default, TARGETS[target])]


def test_the_target_base_never_imports_its_registry() -> None:
    """exporter/targets/base.py is imported by every target module the registry imports: importing the registry
    back, even inside a function, is a loop. The registry hands each target the others (ExportTarget.among)."""
    tree = ast.parse((ROOT / "exporter" / "targets" / "base.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m == "kvforge.exporter.targets" or m.startswith("kvforge.exporter.targets.")}


def test_registered_targets_name_the_others_in_their_refusals() -> None:
    from types import SimpleNamespace

    from kvforge.core.errors import InputError
    from kvforge.exporter.targets import EXPORT_TARGETS

    for target in EXPORT_TARGETS.values():
        assert [peer.name for peer in target.peers] == list(EXPORT_TARGETS)
    options = SimpleNamespace(quantize=None, eagle=None, draft_lm_head_bits=None, kv_cache="int8", dtype="fp32")
    with pytest.raises(InputError, match=r"--kv-cache int8: the trt target's attention .* use --target ort$"):
        EXPORT_TARGETS["trt"].check_options(options)
    assert EXPORT_TARGETS["trt"].others(lambda _t: True) == "--target ort or --target onnx"


def test_every_family_states_hook_is_what_the_exporter_calls() -> None:
    from kvforge.models.families import family_modules
    from kvforge.models.families.state_binding import FamilyStates

    hooks = {name: family.states for name, family in family_modules().items() if family.states is not None}
    assert hooks, "no family keeps its state outside transformers' cache"
    for name, hook in hooks.items():
        for method in ("probe", "bind"):
            want = list(inspect.signature(getattr(FamilyStates, method)).parameters)[1:]
            assert list(inspect.signature(getattr(hook, method)).parameters) == want, (name, method)
