"""The architecture coverage sweep (kvforge/models/coverage.py): its table covers every causal-LM type
of the installed transformers, README shows it, the registry is its passing set, a type it does not
pass is refused at export with its recorded reason, and a re-run of a sample reproduces the table."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kvforge.errors import UnsupportedModelError  # noqa: E402
from kvforge.models.coverage import (  # noqa: E402
    ATOL,
    OUT_OF_SCOPE,
    causal_lm_types,
    coverage_table,
    load_coverage,
    sweep_one,
)
from kvforge.models.families import FAMILIES, family_for  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
ROWS = load_coverage()["types"]


def test_the_table_lists_every_causal_lm_type_of_the_installed_transformers() -> None:
    assert set(ROWS) == set(causal_lm_types())


def test_readme_shows_the_coverage_table() -> None:
    assert coverage_table() in README.read_text(), "README's coverage table drifted: paste coverage_table()"


def test_the_registry_is_the_passing_set() -> None:
    passing = {name for name, row in ROWS.items() if row["status"] == "pass"}
    assert passing == set(FAMILIES)
    for name in passing:
        assert all(result["max_abs_err"] <= ATOL for result in ROWS[name]["targets"].values()), name


def test_every_other_type_has_a_reason_and_export_refuses_it_with_that_reason() -> None:
    for name, row in ROWS.items():
        if row["status"] == "pass":
            continue
        assert row["reason"], name
        assert row["status"] != "out of scope" or OUT_OF_SCOPE[name] == row["reason"]
        with pytest.raises(UnsupportedModelError) as caught:
            family_for(SimpleNamespace(model_type=name, architectures=None))
        assert row["reason"] in str(caught.value)
        assert "\n" not in str(caught.value)


# One passing type with parallel attention/MLP and partial rotary, one refused type: a re-run gives
# the recorded status (and a logit error within the tolerance). KVFORGE_FULL_SWEEP=1 re-runs them all.
SAMPLE = ["gpt_neox", "bloom"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SAMPLE if not os.environ.get("KVFORGE_FULL_SWEEP") else sorted(ROWS))
def test_a_rerun_of_the_sweep_reproduces_the_table(model_type: str) -> None:
    row = sweep_one(model_type, ("ort", "onnx"))
    assert row["status"] == ROWS[model_type]["status"], row
    for target, result in row.get("targets", {}).items():
        assert result["status"] == ROWS[model_type]["targets"][target]["status"], (target, result)
