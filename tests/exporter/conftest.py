"""Fixtures only the exporter's tests use (the run-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_exports import made_once as _made_once
from shared_exports import shared_folder as _shared_folder


@pytest.fixture(scope="session")
def eagle_plain(tmp_path_factory: pytest.TempPathFactory, eagle_export):
    """eagle_plain(recipe) -> eagle_export's target exported for ort without its head (logits compared exactly)."""
    from kvforge.exporter.export import export_model

    root = _shared_folder(tmp_path_factory, "eagle")

    def get(recipe: str) -> Path:
        source = eagle_export(recipe, "ort")[1]
        return _made_once(root, f"{recipe}-ort-plain", lambda out: export_model(source / "hf", out, target="ort"))

    return get
