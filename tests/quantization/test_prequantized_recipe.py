"""`--recipe llama-tiny-autoround`: a pre-quantised import to try offline (issue 53, first hour 6). The recipe's
folder is a checkpoint AutoRound itself quantised on the CPU, saved in AutoRound's own layout; docs/quantisation.md's
two commands, run as written, export it with its integers carried over and pass parity through its dequantised twin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme_examples import doc_block

pytest.importorskip("torch")
pytest.importorskip("auto_round")
pytestmark = pytest.mark.xdist_group("prequantized")


def test_the_autoround_recipe_exports_its_integers_and_passes_parity_as_the_docs_say(tmp_path) -> None:
    block = doc_block("kvforge export --recipe llama-tiny-autoround", "docs/quantisation.md")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = json.loads((tmp_path / "tiny-autoround.hf" / "config.json").read_text())["quantization_config"]
    assert checkpoint["quant_method"] == "auto-round" and checkpoint["packing_format"] == "auto_round:auto_gptq"
    assert not list((tmp_path / "tiny-autoround.hf").glob("autoround-work"))  # AutoRound's own folder is gone
    manifest = json.loads((tmp_path / "tiny-autoround" / "kvforge.json").read_text())
    carried = manifest["quantization"]["integer_weights"]
    assert carried["source"] == "auto-round" and carried["rounded"] == [] and carried["carried_over"] > 0, carried
    assert "PASS" in result.stdout and "dequantised twin" in result.stderr  # parity, through the twin
    assert (tmp_path / "tiny-autoround.dequantised.hf" / "config.json").is_file()
    assert "Quantizing" not in result.stderr  # AutoRound's progress bars are not the recipe's to show


def test_the_recipe_is_listed_and_not_among_the_families_parity_recipes() -> None:
    from kvforge.models.recipes import FAMILY_RECIPES, RECIPES

    assert RECIPES["llama-tiny-autoround"].prequantised == "auto-round"
    assert "llama-tiny-autoround" not in FAMILY_RECIPES  # it is an import to try, not a family's fixture
    listed = subprocess.run([sys.executable, "-m", "kvforge.cli", "recipes"], capture_output=True, text=True)
    assert "llama-tiny-autoround" in listed.stdout
