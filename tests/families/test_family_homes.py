"""Every model family has one home (models/families/): generic code never compares a model_type or a model class
name, and every change an export makes to a loaded model or to transformers' modules is undone when it ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvforge.tools.coverage_fixtures import build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("family_homes")

# Generic code: every module outside a family module (the sweep's tiny configs per type are kvforge/tools/ fixtures).
GENERIC = ["exporter", "runtime", "plugins", "kvforge/core", "kvforge/engines", "kvforge/serve", "models"]
FAMILY_MODULE_HELPERS = {"__init__.py", "family.py", "registry.py", "surgery.py", "state_binding.py"}
SWEEP_FIXTURES: set[str] = set()  # the sweep's fixtures live in kvforge/tools/, outside the generic layers
NAME_TEST = re.compile(r"model_type\s*(==|!=|(not )?in)\s*[\"'(\[{]|__name__\s*(==|!=|(not )?in)\s*[\"'(\[{]")


def _generic_modules() -> list[Path]:
    files = []
    for folder in GENERIC:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            in_family_folder = relative.startswith("models/families/")
            if relative in SWEEP_FIXTURES or (in_family_folder and path.name not in FAMILY_MODULE_HELPERS):
                continue
            files.append(path)
    return files


def name_comparisons(source: str) -> list[str]:
    """Lines of `source` that compare a model_type or a class name with a literal (`__main__` aside)."""
    return [line.strip() for line in source.splitlines()
            if NAME_TEST.search(line) and "__main__" not in line and "Tensor" not in line]


def test_no_generic_module_compares_a_model_type_or_class_name() -> None:
    found = [f"{path.relative_to(ROOT)}: {line}" for path in _generic_modules()
             for line in name_comparisons(path.read_text())]
    assert not found, "family names compared outside models/families/:\n" + "\n".join(found)
    assert len(_generic_modules()) > 80  # the walk sees the tree


@pytest.mark.parametrize("line", [
    'if config.model_type == "gpt2":',
    "name = 'a' if config.model_type != 'qwen4_exp_text' else 'b'",
    'return sum(type(m).__name__ in ("DbrxExperts",) for m in model.modules())',
    'if type(module).__name__ == "DbrxExperts":',
])
def test_the_grep_sees_each_kind_of_name_comparison(line: str) -> None:
    assert name_comparisons(line) == [line]


def _snapshot(model) -> dict[str, tuple]:
    """Per module: its own attributes' names, its parameters, buffers and submodules (by identity) and its own
    forward, if it has one."""
    return {name: (sorted(vars(module)), {k: id(v) for k, v in module._parameters.items()},
                   {k: id(v) for k, v in module._buffers.items()}, {k: id(v) for k, v in module._modules.items()},
                   vars(module).get("forward"))
            for name, module in model.named_modules()}


# mpt: a module global of transformers and routed forwards; dbrx: looped experts (parameters dropped, buffers and
# a forward added); mixtral: the experts implementation and the MoE node's buffers; deepseek_v32: an indexer
# submodule replaced; rwkv: a class attribute patched per traced call.
@pytest.mark.parametrize("model_type", ["mpt", "dbrx", "mixtral", "deepseek_v32", "rwkv"])
def test_an_export_leaves_the_model_and_transformers_as_they_were(model_type, tmp_path, monkeypatch) -> None:
    import sys

    from transformers.models.mpt import modeling_mpt

    from kvforge.exporter import graphs
    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry

    model = build_tiny(model_type, tmp_path / "hf")
    registry = trial_registry(model_type, model.config.architectures[0], model.config)
    modeling = sys.modules[type(model).__module__]
    module_globals = dict(vars(modeling))
    mask = modeling_mpt.create_causal_mask
    loaded, before = [], []
    load = graphs.load_hf_model

    def keep(*args, **kwargs):  # the model the export loads, and how it was when loaded
        model = load(*args, **kwargs)
        loaded.append(model)
        before.append((_snapshot(model), model.config._experts_implementation))
        return model

    monkeypatch.setattr(graphs, "load_hf_model", keep)
    export_model(tmp_path / "hf", tmp_path / "out", target="ort", stream=False, families=registry)
    assert loaded, "the export did not load the whole model"
    assert (_snapshot(loaded[0]), loaded[0].config._experts_implementation) == before[0]
    assert modeling_mpt.create_causal_mask is mask
    changed = {k for k, v in vars(modeling).items() if module_globals.get(k, object()) is not v}
    assert not changed, changed


def test_parity_after_an_export_in_one_process_runs_an_unpatched_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.mpt import modeling_mpt

    from kvforge.exporter.export import export_model
    from kvforge.models.families import trial_registry
    from kvforge.tools.parity import run_parity

    model = build_tiny("mpt", tmp_path / "hf")
    original = modeling_mpt.create_causal_mask
    registry = trial_registry("mpt", model.config.architectures[0], model.config)
    export_model(tmp_path / "hf", tmp_path / "out", target="ort", families=registry)
    assert modeling_mpt.create_causal_mask is original
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
        torch.testing.assert_close(fresh(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    report = run_parity(tmp_path / "hf", tmp_path / "out", new_tokens=8, perplexity_tokens=0)
    assert report.passed and report.max_abs_err < 1e-3, report
