"""The coverage sweep's recorded outcomes (kvforge/data/coverage.json), as the registry reads them: which types
pass, which are refused and why, which are out of scope. The sweep itself, its tiny configs and the table it
renders live in kvforge/tools/ (coverage_sweep, coverage_fixtures, coverage_table)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

# kvforge.data in every layout (the repository's folders, an installed wheel, an editable install).
COVERAGE_FILE = Path(str(resources.files("kvforge") / "data" / "coverage.json"))


def load_coverage() -> dict[str, Any]:
    return json.loads(COVERAGE_FILE.read_text()) if COVERAGE_FILE.is_file() else {"types": {}}


def out_of_scope(model_type: Any) -> bool:
    """Whether the sweep recorded `model_type` as out of kvforge's scope (not an attention decoder)."""
    row = load_coverage()["types"].get(model_type) if isinstance(model_type, str) else None
    return bool(row) and row["status"] == "out of scope"
