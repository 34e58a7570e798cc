"""The architecture coverage sweep (kvforge/tools/coverage_sweep.py, its fixtures in kvforge/tools/coverage_fixtures.py): its table covers every causal-LM type
of the installed transformers, the documentation site shows it (README its summary), the registry is its passing set, a type it does not
pass is refused at export with its recorded reason, and a re-run of a sample reproduces the table."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import UnsupportedModelError  # noqa: E402
from kvforge.models.coverage_data import load_coverage  # noqa: E402
from kvforge.models.families import HAND_WRITTEN, families, family_for, trial_registry  # noqa: E402
from kvforge.tools.coverage_fixtures import (  # noqa: E402
    ATOL,
    OUT_OF_SCOPE,
    REQUIRED_TARGETS,
    build_tiny,
    causal_lm_types,
)
from kvforge.tools.coverage_table import coverage_table  # noqa: E402

FAMILIES = families()
from kvforge.tools.coverage_sweep import check_target, sweep_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROWS = load_coverage()["types"]


def test_the_table_lists_every_causal_lm_type_of_the_installed_transformers() -> None:
    assert set(ROWS) == set(causal_lm_types())


def test_the_docs_show_the_coverage_table_and_readme_its_summary() -> None:
    # docs/hooks.py writes coverage_table() into docs/models.md where the page asks for it (mkdocs build).
    from test_docs import _hooks

    assert coverage_table() in _hooks().render((ROOT / "docs" / "models.md").read_text())
    assert coverage_table().splitlines()[0] in (ROOT / "README.md").read_text(), "README's coverage summary drifted"


def test_the_registry_is_the_passing_set() -> None:
    passing = {name for name, row in ROWS.items() if row["status"] == "pass"}
    assert passing == set(FAMILIES)
    for name in passing:
        targets = ROWS[name]["targets"]
        assert all(targets[target]["status"] == "pass" for target in REQUIRED_TARGETS), name
        assert all(result["max_abs_err"] <= ATOL for result in targets.values() if result["status"] == "pass"), name
        assert (targets["trt"]["status"] == "fail") == (FAMILIES[name].trt_refusal is not None), name
        if FAMILIES[name].swept:
            assert FAMILIES[name].architectures == (ROWS[name]["architecture"],)


def test_a_type_that_fails_on_trt_in_the_sweep_is_refused_there(hf_folder, tmp_path, monkeypatch) -> None:
    import dataclasses

    from kvforge.exporter.export import export_model

    why = "the kernel's emulation disagrees with HF"
    registry = {**FAMILIES, "llama": dataclasses.replace(FAMILIES["llama"], trt_refusal=why)}
    with pytest.raises(UnsupportedModelError, match=f"--target trt cannot export llama .*{why}.*--target ort"):
        export_model(hf_folder("llama-tiny"), tmp_path / "out", target="trt", families=registry)
    assert not (tmp_path / "out").exists()  # refused before any work


# By their class names (a lower bound: MiniMax-M2 and others are MoE without saying so).
MOE_TYPES = sorted(name for name, row in ROWS.items() if row["status"] == "pass" and any(
    key in (row.get("architecture") or "").lower() for key in ("moe", "mixtral")))


def test_at_least_five_mixture_of_experts_types_pass() -> None:
    assert len(MOE_TYPES) >= 5, MOE_TYPES


# dbrx and longcat_flash: experts modules written as a loop over the picked experts (their family modules'
# looped_experts), LongCat's with zero-computation identity experts besides its routed ones. afmoe: a router HF
# initialises to zeros, which build_tiny randomises (all experts tied, torch and ONNX TopK once picked differently).
# Every type runs on `ort`: the routing into the MoE node (exporter/experts_routing.py: prepare_experts for
# qwen3_moe, mixtral, afmoe; prepare_looped_experts for dbrx, longcat_flash) is per type and before the lowering,
# and only `ort` tells a type routed through the node (its stacked weights read by MoE alone) from one left in
# transformers' batched_mm gather form (read by Gather, which the `onnx` check below would also accept). The
# lowering is per target and reads only the node (exporter/targets/moe_ort.py, moe_plain.py): these types' nodes
# are all SiLU-gated without biases, so the plain lowering differs by type only where the node's inputs do:
# longcat_flash's identity experts, whose picks reach it as expert 0 at weight 0 (experts_routing._looped_forward).
# So `onnx` runs longcat_flash alone; both lowerings' arithmetic on every node form (weights not summing to 1,
# weight-0 and repeated picks, biases, the clamp) is checked against the node's reference in
# tests/families/test_moe_node.py::test_each_lowering_computes_the_node.
MOE_CASES = [(model_type, "ort") for model_type in ("qwen3_moe", "mixtral", "dbrx", "longcat_flash", "afmoe")] + \
    [("longcat_flash", "onnx")]


@pytest.mark.parametrize(("model_type", "target"), MOE_CASES)
def test_moe_experts_are_not_computed_densely(model_type: str, target: str, tmp_path) -> None:
    # Each token runs only its top-k experts. On `ort` the stacked [experts, ...] weights feed only
    # ONNX Runtime's MoE op (one per layer); on `onnx` they reach the math only through a Gather of the
    # picked experts. A dense export (every expert on every token, weighted by zero) would feed them to
    # MatMul/Einsum whole. The export also passes parity.
    import onnx

    model = build_tiny(model_type, tmp_path / "hf")
    config = model.config
    experts = {"mixtral": "num_local_experts", "longcat_flash": "n_routed_experts"}.get(model_type, "num_experts")
    experts = config.ffn_config.moe_num_experts if model_type == "dbrx" else getattr(config, experts)
    moe_layers = sum(type(module).__name__.endswith("Experts") for module in model.modules())
    # As the sweep tries a type (the registry with it), so the check does not depend on coverage.json's rows.
    registry = trial_registry(model_type, type(model).__name__, config)
    result = check_target(model_type, tmp_path / "hf", tmp_path / "out", target, model, families=registry)
    assert result["status"] == "pass", result
    for graph_name in ("prefill.onnx", "decode.onnx"):
        graph = onnx.load(tmp_path / "out" / graph_name, load_external_data=False).graph
        stacked = {init.name for init in graph.initializer if len(init.dims) == 3 and init.dims[0] == experts}
        assert len(stacked) >= 2 * moe_layers > 0, (graph_name, stacked)
        readers = [node.op_type for node in graph.node for name in node.input if name in stacked]
        if target == "ort":
            assert readers == ["MoE"] * len(stacked), (graph_name, readers)
        else:
            assert set(readers) <= {"Gather", "GatherND", "GatherElements"}, (graph_name, readers)


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


# One passing type with parallel attention/MLP and partial rotary, one with an RMSNorm eps of 1e-8 and a
# padding row of zeros (the graph clean-up once deleted that eps), one refused type (MoE: above): a re-run gives
# the recorded status (and a logit error within the tolerance). KVFORGE_FULL_SWEEP=1 re-runs them all.
# gemma3n_text (its activation sparsity on in the sweep's config) is not in the sample: that point is held by
# tests/families/test_gemma3n_export.py, which exports the sweep's own gemma3n_text config (sparsity 0.95 on the
# first two layers' MLPs, KV shared by the last two) and checks it against HF eager with the sweep's prompts,
# token count and tolerance, and tests/families/test_adapters.py (the sweep's config keeps the sparsity on; the
# sparse MLPs equal HF's). The quantile is a constant in the graph before any lowering, so one target shows it.
SAMPLE = ["gpt_neox", "helium", "bloom"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SAMPLE if not os.environ.get("KVFORGE_FULL_SWEEP") else sorted(ROWS))
def test_a_rerun_of_the_sweep_reproduces_the_table(model_type: str) -> None:
    row = sweep_one(model_type, ("ort", "onnx"))
    assert row["status"] == ROWS[model_type]["status"], row
    for target, result in row.get("targets", {}).items():
        assert result["status"] == ROWS[model_type]["targets"][target]["status"], (target, result)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_attention_sinks_export_at_parity(target: str, tmp_path) -> None:
    # gpt-oss: a learned sink logit per head joins each softmax (GQA's head_sink on `ort`, an extra zero
    # key/value column with the sink in the mask on `onnx`). Sinks of a few units take most of the
    # probability mass at these lengths, so an export that dropped them would fail parity (checked below).
    import onnx
    import torch

    model = build_tiny("gpt_oss", tmp_path / "hf")
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    ids = torch.tensor([[5, 9, 2, 7, 1, 4]])
    with torch.no_grad():
        for sink in sinks:
            sink.fill_(float("-inf"))  # exp(-inf) = 0: no sink
        without = model(ids).logits
        for sink in sinks:
            sink.copy_(torch.linspace(-2.0, 3.0, sink.numel()))
        with_sinks = model(ids).logits
    assert (with_sinks - without).abs().max() > 50 * ATOL
    model.save_pretrained(tmp_path / "hf")
    result = check_target("gpt_oss", tmp_path / "hf", tmp_path / "out", target, model)
    assert result["status"] == "pass", result
    graph = onnx.load(tmp_path / "out" / "decode.onnx", load_external_data=False).graph
    attention = [node for node in graph.node if node.op_type in ("GroupQueryAttention", "Attention")]
    assert len(attention) == model.config.num_hidden_layers
    if target == "ort":
        assert all(len(node.input) >= 12 and node.input[11] for node in attention)  # head_sink
    else:
        assert all(len(node.input) == 4 for node in attention)


def test_attention_sinks_are_refused_on_trt_before_any_work(tmp_path) -> None:
    from kvforge.exporter.export import export_model

    build_tiny("gpt_oss", tmp_path / "hf")
    with pytest.raises(UnsupportedModelError, match="--target trt cannot export gpt_oss.*sinks.*--target ort"):
        export_model(tmp_path / "hf", tmp_path / "out", target="trt")
    assert not (tmp_path / "out").exists()


def test_a_rerun_tries_a_swept_type_afresh_so_its_trt_refusal_can_clear() -> None:
    from kvforge.models.families import trial_registry

    assert FAMILIES["gpt_neox"].swept
    registry = trial_registry("gpt_neox", "GPTNeoXForCausalLM")
    assert registry["gpt_neox"].trt_refusal is None and registry["gpt_neox"] is not FAMILIES["gpt_neox"]
    assert families()["gpt_neox"] is FAMILIES["gpt_neox"]  # the registry itself never changes
    assert trial_registry("llama", "LlamaForCausalLM")["llama"] is HAND_WRITTEN["llama"]  # hand-written keeps its own
    with pytest.raises(TypeError):
        families()["llama"] = HAND_WRITTEN["llama"]  # read-only


def test_real_shape_configs_keep_the_default_layer_shapes() -> None:
    from transformers import AutoConfig

    from kvforge.tools.coverage_fixtures import tiny_config

    for model_type in ("qwen3_moe", "starcoder2", "gemma3_text"):
        default, real = AutoConfig.for_model(model_type), tiny_config(model_type, real=True)
        for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                      "moe_intermediate_size", "num_experts", "sliding_window"):
            if hasattr(default, field):
                assert getattr(real, field) == getattr(default, field), (model_type, field)
        kinds = len(set(getattr(default, "layer_types", None) or ["one"]))
        assert real.num_hidden_layers == kinds and real.vocab_size == 512


def test_a_real_shape_row_tells_memory_from_failure() -> None:
    from kvforge.tools.coverage_fixtures import real_summary

    ok = {"status": "pass", "max_abs_err": 2e-6}
    assert real_summary("opt", {"targets": {"ort": ok, "onnx": ok}})["status"] == "pass"
    oom = {"status": "fail", "error": "InputError <- MemoryError: Cannot allocate memory (os error 12)"}
    memory = real_summary("opt", {"targets": {"ort": ok, "onnx": oom}})
    assert memory["status"] == "memory" and memory["targets"] == {"ort": "pass", "onnx": "memory"}
    wrong = {"status": "fail", "error": "prompt 0: max logit error 0.5 > atol 0.001 (step 3)"}
    summary = real_summary("opt", {"targets": {"ort": wrong, "onnx": oom}})
    assert summary["status"] == "fail" and "max logit error" in summary["error"]
    assert summary["shape"].startswith("768, 12/12 heads of 64")


@pytest.mark.slow
def test_a_real_shape_rerun_passes() -> None:
    # OPT at its default (OPT-125m) layer shapes: one layer, the real hidden size and heads.
    row = sweep_one("opt", ("ort", "onnx"), real=True)
    assert row["status"] == "pass" and ROWS["opt"]["real"]["status"] == "pass", row


def test_the_registry_reads_no_file_at_import() -> None:
    # The coverage data is read when the registry is first asked for, not when kvforge is imported.
    import subprocess
    import sys

    code = ("import kvforge.models.families as f, kvforge.exporter.export, kvforge.cli; "
            "assert f.families.cache_info().currsize == 0, 'read at import'; f.families(); "
            "assert f.families.cache_info().currsize == 1")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_passing_type_records_its_tensorrt_rtx_build() -> None:
    # The table's TensorRT-RTX column: each passing type's engines were built (or refused in one line, or failed
    # with the builder's error), none left unrecorded.
    for name, row in ROWS.items():
        if row["status"] == "pass":
            entry = row.get("rtx")
            assert entry and entry["status"] in ("built", "refused", "fail"), name
            assert entry["status"] == "built" or "\n" not in entry["error"], name


def test_the_rtx_build_is_real_and_a_model_with_state_is_refused_in_one_line() -> None:
    pytest.importorskip("tensorrt_rtx", reason="needs TensorRT for RTX: pip install -e '.[trt-rtx]'")
    from kvforge.tools.coverage_sweep import rtx_one

    built = rtx_one("qwen2")
    assert built["status"] == "built" and built["seconds"] > 0 and "fused" in built["attention"], built
    refused = rtx_one("mamba")
    assert refused["status"] == "refused" and "keep a state" in refused["error"], refused
    assert "/tmp" not in refused["error"] and "\n" not in refused["error"]
