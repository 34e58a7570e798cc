"""The quantisation plan (exporter/quantization/plan.py): the method's and the lm_head's defaults decided in one
function, with their reasons; quantisation kept in exporter/quantization/ (generic exporter modules import only the
plan); and an export opening each checkpoint file's header, and a pre-quantised layout, once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvforge.exporter.options import ExportOptions
from kvforge.exporter.quantization.plan import QuantPlan, QuantSource

ROOT = Path(__file__).resolve().parents[2]


def _plan(parameters: int, kind: str | None = None, **options) -> QuantPlan:
    return QuantPlan.resolve(ExportOptions(**options), QuantSource(kind, parameters))


def test_the_default_method_is_hqq_under_1b_parameters_autoround_in_fp16_and_rtn_otherwise() -> None:
    assert _plan(135_000_000, quantize="int4").method == "hqq"
    assert _plan(135_000_000, quantize="int4", dtype="fp16").method == "autoround"  # HQQ: fp32 only
    large = _plan(8_000_000_000, quantize="int4")
    assert (large.method, large.method_why) == (
        "rtn", "rtn: the default from 1B parameters (8.0B here: HQQ holds the whole model, calibrating would take "
               "hours on a CPU; --quant-method hqq or autoround anyway)")
    assert _plan(135_000_000, "gguf", quantize="int4").origin == "gguf"  # its Q4_0/Q4_1/Q4_K/Q8_0 blocks carried over
    assert (_plan(135_000_000, quantize="int8").method, _plan(135_000_000, quantize="int8").method_why) == ("rtn", None)
    given = _plan(135_000_000, quantize="int4", quant_method="rtn")
    assert (given.method, given.method_why, given.origin) == ("rtn", None, "rtn")  # given: no reason to give
    assert _plan(135_000_000, quantize="int4", calibration="text.txt").method == "autoround"


def test_the_lm_head_is_8_bit_by_default_under_1b_parameters_only_where_the_weights_are_rounded() -> None:
    small = _plan(135_000_000, quantize="int4")
    assert small.lm_head_bits == 8 and small.lm_head_why.startswith("lm_head at 8 bits: the default for models under 1B")
    assert "135M" in small.lm_head_why
    assert _plan(7_000_000_000, quantize="int4").lm_head_bits is None  # a large model: every weight at 4 bits
    assert _plan(135_000_000, quantize="int8").lm_head_bits is None
    assert _plan(135_000_000, quantize="int4", lm_head_bits=4).lm_head_why is None  # given
    assert _plan(135_000_000, "prequantized", quantize="int4", quant_method="rtn").lm_head_bits is None  # kept float
    assert _plan(135_000_000, "gguf", quantize="int4").lm_head_bits == 8  # the rest is rounded
    assert _plan(135_000_000).record() == {"parameters": 135_000_000}  # a float export: no reasons


def _decides_reasons(path: Path) -> list[str]:
    """The functions of `path` that spell a default's reason (the phrases _choose writes)."""
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{node.name}" for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(isinstance(c, ast.Constant) and isinstance(c.value, str) and
                    c.value.startswith(("rtn: the default from 1B", "lm_head at 8 bits: the default", "hqq: int4 fitted"))
                    for c in ast.walk(node))]


def test_the_methods_and_lm_heads_reasons_are_decided_in_one_function() -> None:
    found = [hit for folder in ("exporter", "models", "kvforge") for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in _decides_reasons(path)]
    assert found == ["plan.py:_choose"]


# Generic exporter modules (exporter/*.py) import from exporter/quantization/ its plan only; the target lowerings
# (exporter/targets/) also the experts' int4 blocks, which ONNX Runtime's QMoE lowering lays out itself.
ALLOWED = {"exporter": {"plan"}, "exporter/targets": {"plan", "experts"}}
PACKAGE = "kvforge.exporter.quantization"


def quantization_imports(source: str) -> set[str]:
    """The exporter/quantization/ modules `source` imports, in any scope (`from PACKAGE import x` names module x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != PACKAGE else [f"{PACKAGE}.{a.name}" for a in node.names]
        else:
            continue
        found |= {name[len(PACKAGE) + 1:].split(".")[0] or "(package)" for name in names
                  if name == PACKAGE or name.startswith(PACKAGE + ".")}
    return found


def quantization_rule_violations(root: Path) -> list[str]:
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((root / folder).glob("*.py")):
            extra = quantization_imports(path.read_text()) - allowed
            wrong += [f"{path.relative_to(root)} imports exporter/quantization/{name}" for name in sorted(extra)]
    return wrong


def test_generic_exporter_modules_import_only_the_quantisation_plan() -> None:
    assert quantization_rule_violations(ROOT) == []
    # every module that rounds, fits or carries integers is in the package (none left beside it)
    left = [name for name in ("quantize.py", "quantize_tensors.py", "exact_blocks.py", "float_offsets.py",
                              "calibrate.py", "kv_quant.py", "draft_quant.py") if (ROOT / "exporter" / name).exists()]
    left += [name for name in ("prequantized.py", "prequantized_convert.py", "int_weights.py", "gguf_blocks.py")
             if (ROOT / "models" / name).exists()]
    assert left == []


@pytest.mark.parametrize("source", [
    "from kvforge.exporter.quantization.matmuls import quantize_model\n",
    "def later():\n    from kvforge.exporter.quantization import rtn\n",
    "import kvforge.exporter.quantization.kv_cache\n",
])
def test_the_rule_catches_a_generic_module_reaching_into_a_pass(tmp_path, source) -> None:
    (tmp_path / "exporter" / "targets").mkdir(parents=True)
    (tmp_path / "exporter" / "fine.py").write_text("from kvforge.exporter.quantization.plan import QuantPlan\n")
    assert quantization_rule_violations(tmp_path) == []
    (tmp_path / "exporter" / "bad.py").write_text(source)
    assert len(quantization_rule_violations(tmp_path)) == 1, source


def _count_reads(monkeypatch) -> dict[str, list[str]]:
    """Wrap what reads a checkpoint's headers or a pre-quantised layout, recording what each read."""
    from kvforge.exporter import checkpoint
    from kvforge.exporter.quantization import prequantized, prequantized_convert

    reads: dict[str, list[str]] = {"header": [], "layout": [], "integers": [], "checkpoint": []}

    def counted(module, name, kind, what):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            reads[kind].append(what(*args))
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(checkpoint, "_read_header", "header", lambda file: Path(file).name)
    counted(checkpoint, "open_checkpoint", "checkpoint", lambda folder: Path(folder).name)
    counted(prequantized_convert, "read_quantization_config", "layout", lambda folder: Path(folder).name)
    original_init = prequantized.PrequantizedWeights.__init__

    def weights_init(self, model_dir, layout):
        reads["integers"].append(Path(model_dir).name)
        original_init(self, model_dir, layout)
    monkeypatch.setattr(prequantized.PrequantizedWeights, "__init__", weights_init)
    from kvforge.exporter import export  # the name export.py calls

    monkeypatch.setattr(export, "open_checkpoint", checkpoint.open_checkpoint)
    return reads


def test_an_int4_export_opens_its_checkpoint_once(hf_folder, tmp_path, monkeypatch) -> None:
    # The method left to its default: choosing it counts the checkpoint's parameters (it opened it twice before).
    from kvforge.exporter.export import export_model

    reads = _count_reads(monkeypatch)
    export_model(hf_folder("llama-tiny"), tmp_path / "out", quantize="int4")
    assert reads["checkpoint"] == ["llama-tiny"] and reads["header"] == ["model.safetensors"], reads
    assert reads["layout"] == ["llama-tiny"], reads  # config.json asked once whether it is pre-quantised
    # `kvforge inspect` gives the plan's reasons, as the manifest recorded them
    from click.testing import CliRunner

    from kvforge.cli import main

    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "out")])
    assert shown.exit_code == 0, shown.output
    assert "quantization: int4 weights (hqq), blocks of 32, accuracy level 4, 8-bit lm_head" in shown.output
    assert "why the method: hqq: int4 fitted with HQQ, the default under 1B parameters" in shown.output
    assert "why the lm_head: lm_head at 8 bits: the default for models under 1B parameters" in shown.output


def test_a_prequantized_export_reads_its_layout_and_its_integers_once(hf_folder, tmp_path, monkeypatch) -> None:
    from prequantized_checkpoints import make

    from kvforge.exporter.export import export_model

    make(tmp_path / "gptq", hf_folder("llama-tiny"), "gptq")
    reads = _count_reads(monkeypatch)
    export_model(tmp_path / "gptq", tmp_path / "out")
    assert reads["layout"] == ["gptq"], reads
    assert reads["integers"] == ["gptq"], reads  # its shards' headers read once, into PrequantizedWeights
    assert reads["checkpoint"] == ["out.hf"] and reads["header"] == ["model.safetensors"], reads  # the twin, once
