"""EAGLE-3 speculation heads exported as draft.onnx (`kvforge export --eagle`, exporter/draft_head.py): 8-layer tiny
Llama and Qwen3 targets (the recipes' configs with more layers, seeded random weights) with seeded random heads
(models/eagle3_checkpoint.py: speculators' form for Llama, EAGLE's for Qwen3), exported for ort and onnx once per
run (tests/head_exports.py through conftest's eagle_export, shared with the other head tests).

draft.onnx, run with ONNX Runtime over its own KV cache (past and present bound to one buffer, as the runtime binds
it), must equal the torch reference (models/eagle3_reference.py) within 1e-4 in fp32 through a chain: the prompt's
pairs in one call, a draft from the target's state, two drafts fed the head's own hidden_out, then a
multi-position catch-up over the drafted positions. The target graphs' `target_hidden` is HF's output_hidden_states
at the aux layers; the target's logits are HF's within 1e-4 and (Llama, ort) those of the export without a head; bad heads and --target trt are
refused in one line with nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from head_exports import BoundHead, one_thread_session

pytest.importorskip("torch")

from kvforge.core.contract import TARGET_HIDDEN  # noqa: E402
from kvforge.core.errors import InputError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402

pytestmark = pytest.mark.xdist_group("eagle3")

CASES = (("llama-tiny", "speculators", "ort"), ("llama-tiny", "speculators", "onnx"),
         ("qwen3-tiny", "eagle", "ort"), ("qwen3-tiny", "eagle", "onnx"))
LAYERS = 8  # head_exports.LAYERS: EAGLE's default aux layers (2, L // 2, L - 3) are distinct from 7 layers on
CAPACITY = 32
TOLERANCE = 1e-4  # fp32: ONNX Runtime's attention over the bound cache against explicit attention in torch


@pytest.fixture(scope="module")
def models(eagle_export):
    """recipe -> (source root with hf/ and head/, HF model): the targets (tests/head_exports.py), shared by the cases."""
    from head_exports import load_hf

    return {recipe: (eagle_export(recipe, "ort")[1], load_hf(eagle_export(recipe, "ort")[1] / "hf"))
            for recipe in sorted({case[0] for case in CASES})}


# The `onnx` cases repeat the `ort` ones through the other lowering: in the full suite, not CI's tier.
@pytest.fixture(scope="module", params=[pytest.param(case, marks=pytest.mark.slow) if case[2] == "onnx" else case
                                        for case in CASES], ids=["-".join(case) for case in CASES])
def case(request, eagle_export, models):
    """(export folder, HF model, head): the target exported with its head (conftest's eagle_export)."""
    from kvforge.models.eagle3 import read_eagle3_head

    recipe, form, target = request.param
    folder, source = eagle_export(recipe, target)
    model = models[recipe][1]
    head = read_eagle3_head(source / "head", model.config)
    assert head.form == form
    return folder, model, head


@pytest.fixture(scope="module")
def targets(models):
    """recipe -> (root, HF model), root/hf the target's folder."""
    return models




def _run_target(folder, phase: str, ids: list[int], past: int = 0, cache: dict | None = None) -> dict[str, np.ndarray]:
    """One row through the export's prefill or decode graph: its outputs by name (present_* as the next cache)."""
    session = one_thread_session(folder / f"{phase}.onnx")
    feeds = {"input_ids": np.array([ids], np.int64), "past_lens": np.array([past], np.int32)}
    if phase == "prefill":
        feeds["logits_index"] = np.array([[len(ids) - 1]], np.int64)
    for value in session.get_inputs():
        if value.name.startswith("past_") and value.name != "past_lens":
            present = value.name.replace("past_", "present_", 1)
            feeds[value.name] = cache[present] if cache else \
                np.zeros([1, value.shape[1], CAPACITY, value.shape[3]], np.float32)
    names = [value.name for value in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))




def _aux_states(model, ids: list[int], layer_ids) -> np.ndarray:
    import torch

    from kvforge.models.eagle3_reference import target_aux_states

    return target_aux_states(model, torch.tensor([ids]), layer_ids)[0].numpy()


def test_draft_chain_matches_the_reference(case) -> None:
    import torch

    from kvforge.models.eagle3_reference import Eagle3Reference

    folder, model, head = case
    rng = np.random.default_rng(11)
    ids = [int(t) for t in rng.integers(3, 500, size=16)]
    n = 9  # the prompt is ids[:n]; the target's states over the longer sequence are its verified ones
    states = _aux_states(model, ids, head.aux_layer_ids)
    reference = Eagle3Reference(head, model.get_input_embeddings().weight.detach(), 1, CAPACITY)
    onnx_head = BoundHead(folder, CAPACITY)
    zeros = lambda count: np.zeros((count, head.hidden_size), np.float32)  # noqa: E731
    worst = 0.0

    def step(past: int, tokens: list[int], target: np.ndarray | None, draft: np.ndarray | None, where: str):
        nonlocal worst
        count = len(tokens)
        target_in = target if target is not None else np.zeros((count, head.target_hidden_size), np.float32)
        logits, hidden, token_map = onnx_head(past, tokens, target_in, draft if draft is not None else zeros(count))
        reference.past_lens[:] = past  # a rollback is only a shorter past_lens, for the reference as for the graph
        ref_logits, ref_hidden = reference.step(torch.tensor([tokens]), None if target is None else
                                                torch.tensor(target)[None], None if draft is None else
                                                torch.tensor(draft)[None])
        diff = max(np.abs(logits - ref_logits[0].numpy()).max(), np.abs(hidden - ref_hidden[0].numpy()).max())
        assert diff <= TOLERANCE, (where, diff)
        worst = max(worst, float(diff))
        return logits, hidden, token_map

    # Head position p holds (token p + 1, the target's state at p): the prompt's pairs in one call.
    step(0, ids[1:n], states[: n - 1], None, "prompt")
    # The target's next token with its state at n - 1, then two drafts fed the head's own hidden_out.
    logits, hidden, token_map = step(n - 1, [ids[n]], states[n - 1: n], None, "draft 1")
    assert np.array_equal(token_map, head.token_map().numpy())
    assert token_map.max() < model.config.vocab_size and len(token_map) == head.draft_vocab_size
    for k in range(2):
        drafted = int(token_map[int(logits[-1].argmax())])
        logits, hidden, _ = step(n + k, [drafted], None, hidden[-1:], f"draft {k + 2}")
    # Verification took one draft: the target's states over the three positions after it, in one catch-up call
    # that overwrites the drafted positions.
    step(n, ids[n + 1: n + 4], states[n: n + 3], None, "catch-up")
    assert 0.0 < worst  # the chain compared numbers, not two empty outputs


def test_target_hidden_is_hfs_hidden_states_at_the_aux_layers(case) -> None:
    folder, model, head = case
    ids = [5, 17, 200, 33, 9, 480, 71, 12, 3, 44]
    want = _aux_states(model, ids, head.aux_layer_ids)
    prefill = _run_target(folder, "prefill", ids[:-1])
    assert prefill[TARGET_HIDDEN].shape == (1, len(ids) - 1, head.target_hidden_size)
    assert np.abs(prefill[TARGET_HIDDEN][0] - want[:-1]).max() <= TOLERANCE
    decode = _run_target(folder, "decode", ids[-1:], past=len(ids) - 1, cache=prefill)
    assert np.abs(decode[TARGET_HIDDEN][0] - want[-1:]).max() <= TOLERANCE
    manifest = load_manifest(folder)
    assert manifest["graphs"]["prefill"]["outputs"][-1]["name"] == TARGET_HIDDEN
    assert manifest["draft"]["aux_layer_ids"] == list(head.aux_layer_ids)


def test_the_targets_logits_are_unchanged_by_the_head(case, eagle_plain) -> None:
    import torch

    folder, model, _ = case
    ids = [5, 17, 200, 33, 9, 480, 71, 12]
    with_head = _run_target(folder, "prefill", ids)["logits"][0, -1]
    if folder.name == "llama-tiny-ort":  # the export without a head: the same logits (one case suffices: the graph
        plain_folder = eagle_plain("llama-tiny")  # change is the same for every family and target)
        plain = _run_target(plain_folder, "prefill", ids)["logits"][0, -1]
        assert np.array_equal(with_head, plain) or np.abs(with_head - plain).max() <= 1e-5
        assert TARGET_HIDDEN not in [o["name"] for o in load_manifest(plain_folder)["graphs"]["prefill"]["outputs"]]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(with_head - hf).max() <= TOLERANCE


def test_the_draft_record(case) -> None:
    folder, _, head = case
    manifest = load_manifest(folder, verify_hashes=True)
    record = manifest["draft"]
    assert record["kind"] == "eagle3" and record["file"] == "draft.onnx" and "draft.onnx" in manifest["files"]
    assert record["kv_cache"]["num_layers"] == 1 and record["kv_cache"]["num_kv_heads"] == head.num_kv_heads
    assert record["target_hidden_size"] == 3 * manifest["model"]["hidden_size"]
    assert record["draft_vocab_size"] == head.draft_vocab_size and record["format"] == head.form
    attention = manifest["graphs"]["draft"]["attention"]
    assert sum(attention.values()) == 1, attention  # the one fused attention node, lowered like the target's


def _refused(tmp_path, targets, head_dir, message: str, target: str = "ort") -> None:
    from kvforge.exporter.export import export_model

    root, _ = targets["llama-tiny"]
    out = tmp_path / "out"
    with pytest.raises(InputError, match=message):
        export_model(root / "hf", out, target=target, eagle=head_dir)
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_bad_heads_are_refused_in_one_line(tmp_path, targets) -> None:
    from kvforge.models.eagle3_checkpoint import write_random_head

    root, _ = targets["llama-tiny"]
    narrow = tmp_path / "narrow-target"
    narrow.mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    write_random_head(narrow, tmp_path / "narrow", aux_layer_ids=[1, 3, 6])
    _refused(tmp_path, targets, tmp_path / "narrow", r"hidden size 32 does not fit the target \(hidden size 64")
    write_random_head(root / "hf", tmp_path / "far", aux_layer_ids=[1, 3, LAYERS])
    _refused(tmp_path, targets, tmp_path / "far", r"aux layer ids \[1, 3, 8\] out of range: the target has 8 layers")
    unknown = tmp_path / "unknown"
    shutil.copytree(tmp_path / "far", unknown)
    (unknown / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    _refused(tmp_path, targets, unknown, "unknown head format in .*unknown")
    medusa = tmp_path / "medusa"
    shutil.copytree(tmp_path / "far", medusa)
    (medusa / "config.json").write_text(json.dumps({"speculators_model_type": "medusa"}))
    _refused(tmp_path, targets, medusa, "unknown head format .*speculators_model_type 'medusa'")
    write_random_head(root / "hf", tmp_path / "good", aux_layer_ids=[1, 3, 6])
    _refused(tmp_path, targets, tmp_path / "good", "--eagle is not supported with --target trt", target="trt")


def test_the_cli_refuses_eagle_for_trt_with_exit_2(tmp_path, targets) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.models.eagle3_checkpoint import write_random_head

    root, _ = targets["llama-tiny"]
    write_random_head(root / "hf", tmp_path / "head", aux_layer_ids=[1, 3, 6])
    result = CliRunner().invoke(main, ["export", str(root / "hf"), "-o", str(tmp_path / "out"), "--target", "trt",
                                       "--eagle", str(tmp_path / "head")])
    assert result.exit_code == 2 and "--eagle is not supported with --target trt" in result.output, result.output
    assert result.output.strip().count("\n") == 0 and not (tmp_path / "out").exists()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    result = CliRunner().invoke(main, ["export", str(root / "hf"), "-o", str(tmp_path / "out"), "--eagle", str(bad)])
    assert result.exit_code == 2 and "unknown head format" in result.output and not (tmp_path / "out").exists()
