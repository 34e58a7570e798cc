"""A checkpoint's multi-token-prediction layer exported as the speculation head draft.onnx (exporter/mtp_head.py):
tiny DeepSeek-V3 (MLA), GLM-4.5 (glm4_moe: GQA, partial rotary) and Qwen3-Next (gated attention beside linear-attention
layers; its MTP layer under mtp.*, sharing the target's embedding and lm_head) checkpoints with seeded MTP layers added
(models/mtp_fixture.py), exported for ort once per run (conftest's mtp_export, shared with the other head tests). draft.onnx, run with ONNX Runtime over its own KV cache (bound in place),
must equal the torch reference of the checkpoint's MTP module (models/mtp_reference.py: full sequence, no cache)
within 1e-4 in fp32 through a chain: a multi-position prefill, drafts fed their own hidden_out, then a
multi-position catch-up over rewritten positions. The target's logits are HF's within 1e-4 and (DeepSeek-V3) those of the export without a head; its
`target_hidden` is HF's final normed hidden state; --no-mtp exports no head; a broken MTP layer is refused in one
line with nothing written."""

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

pytestmark = pytest.mark.xdist_group("mtp")

FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next")
CAPACITY = 32
TOLERANCE = 1e-4  # fp32: ONNX Runtime's attention over the cache against eager attention over the whole sequence


def _registry(model):
    from kvforge.models.families import trial_registry

    return trial_registry(model.config.model_type, type(model).__name__, model.config)


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, mtp_export):
    """(root, HF target model, reference): the tiny checkpoint with one MTP layer (root/hf), exported with it
    (root/mtp; conftest's mtp_export, made once per run and shared with the other head tests). Read-only."""
    from head_exports import load_hf

    from kvforge.models.mtp_reference import MtpReference

    root = mtp_export(request.param)
    return root, load_hf(root / "hf"), MtpReference(root / "hf")




def _target(folder, ids: list[int]) -> dict[str, np.ndarray]:
    """The export's prefill graph over `ids` (one row, fresh cache): its outputs by name."""
    session = one_thread_session(folder / "prefill.onnx")
    feeds = {"input_ids": np.array([ids], np.int64), "past_lens": np.zeros(1, np.int32),
             "logits_index": np.array([[len(ids) - 1]], np.int64)}
    for value in session.get_inputs():  # KV buffers of CAPACITY positions, recurrent states at their own size
        if value.name.startswith("past_") and value.name != "past_lens":
            shape = [1] + [dim if isinstance(dim, int) else CAPACITY for dim in value.shape[1:]]
            feeds[value.name] = np.zeros(shape, np.float32)
    names = [value.name for value in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))




def _hf_hidden(model, ids: list[int]) -> np.ndarray:
    """HF's final normed hidden state of every position (the target's, which MTP reads)."""
    import torch

    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()


def _check(reference, tokens, given, start, logits, hidden, where: str) -> float:
    """draft.onnx's rows start.. against the reference over the sequence so far; the largest difference."""
    ref_logits, ref_hidden = reference.forward(tokens, given)
    end = start + logits.shape[0]
    worst = max(np.abs(logits - ref_logits[start:end]).max(), np.abs(hidden - ref_hidden[start:end]).max())
    assert worst <= TOLERANCE, (where, worst)
    return float(worst)


def test_draft_chain_matches_the_reference(exported) -> None:
    root, model, reference = exported
    rng = np.random.default_rng(3)
    ids = [int(t) for t in rng.integers(3, 500, size=16)]
    n = 9  # the prompt: ids[:n]; the target's hidden states over the longer sequence are its verified ones
    states = _hf_hidden(model, ids)
    hidden = model.config.hidden_size
    zeros = np.zeros((1, hidden), np.float32)
    head = BoundHead(root / "mtp", CAPACITY)
    # Head position p holds (token p + 1, hidden state at p): the prompt's pairs, in one call.
    tokens, given = ids[1:n], list(states[: n - 1])
    logits, out, token_map = head(0, tokens, states[: n - 1], np.zeros((n - 1, hidden), np.float32))
    assert np.array_equal(token_map, np.arange(model.config.vocab_size))
    _check(reference, tokens, np.array(given), 0, logits, out, "prefill")
    # The target's next token with its hidden state, then two drafts fed the head's own hidden_out.
    tokens.append(ids[n])
    given.append(states[n - 1])
    logits, out, _ = head(n - 1, [ids[n]], states[n - 1][None], zeros)
    _check(reference, tokens, np.array(given), n - 1, logits, out, "first draft")
    for step in range(2):
        drafted = int(logits[-1].argmax())
        tokens.append(drafted)
        given.append(out[-1])
        logits, out, _ = head(len(tokens) - 1, [drafted], zeros, out[-1][None])
        _check(reference, tokens, np.array(given), len(tokens) - 1, logits, out, f"chained draft {step}")
    # Catch-up: the target verified one draft; positions n.. are written again with its tokens and hidden states
    # (three at once), over the cache the drafts left.
    keep = n
    tokens, given = tokens[:keep], given[:keep]
    new = list(range(keep, keep + 3))
    tokens += [ids[p + 1] for p in new]
    given += [states[p] for p in new]
    logits, out, _ = head(keep, [ids[p + 1] for p in new], states[new], np.zeros((3, hidden), np.float32))
    _check(reference, tokens, np.array(given), keep, logits, out, "catch-up")


def test_target_graphs_gain_target_hidden_only(exported, mtp_export) -> None:
    import torch

    root, model, _ = exported
    ids = [5, 17, 300, 42, 9, 77]
    with_head = _target(root / "mtp", ids)
    with torch.no_grad():  # the target's logits are the checkpoint's
        hf = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(with_head["logits"][0, -1] - hf).max() <= TOLERANCE
    if model.config.model_type == "deepseek_v3":  # and those of the export without the head, exactly (one family
        plain = _target(mtp_export("deepseek_v3", plain=True), ids)  # suffices: the graph change is the same)
        assert np.array_equal(with_head["logits"], plain["logits"])
        assert TARGET_HIDDEN not in plain
    assert np.abs(with_head[TARGET_HIDDEN][0] - _hf_hidden(model, ids)).max() <= TOLERANCE
    manifest = load_manifest(root / "mtp")
    for phase in ("prefill", "decode"):
        outputs = {value["name"]: value["shape"] for value in manifest["graphs"][phase]["outputs"]}
        assert outputs[TARGET_HIDDEN][-1] == model.config.hidden_size, phase
    record = manifest["draft"]
    assert (record["kind"], record["file"], record["hidden_size"]) == ("mtp", "draft.onnx", model.config.hidden_size)
    assert record["kv_cache"]["num_layers"] == 1
    assert record["convention"]["target_hidden"] == "final_normed"
    names = _names(model.config)
    assert record["weights"]["proj"] == names["proj"] and record["weights"]["block"] == names["block"]


def test_no_mtp_exports_no_head(mtp_export) -> None:
    plain = mtp_export("deepseek_v3", plain=True)
    manifest = load_manifest(plain)
    assert "draft" not in manifest and "draft" not in manifest["graphs"]
    assert not (plain / "draft.onnx").exists()
    assert TARGET_HIDDEN not in {value["name"] for value in manifest["graphs"]["decode"]["outputs"]}


def _names(config) -> dict[str, str]:
    """The checkpoint names of the first MTP layer's projection, first norm and block prefix (models/mtp.py)."""
    from kvforge.models.mtp import mtp_format

    fmt = mtp_format(config)
    glue = fmt.glue_prefix(config, 0)
    return {"proj": glue + fmt.glue["proj"], "enorm": glue + fmt.glue["enorm"], "block": fmt.block_prefix(config, 0)}


def _broken(root, out, change) -> None:
    """The checkpoint at `out`: the fixture's (root / "hf") with `change(tensors)` applied to its safetensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(root / "hf", out)
    file = out / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["missing", "misshaped", "block"])
def test_a_broken_mtp_layer_is_refused_in_one_line(exported, case, tmp_path) -> None:
    import torch

    from kvforge.exporter.export import export_model

    root, model, _ = exported
    names = _names(model.config)
    changes = {
        "missing": lambda t: t.pop(names["proj"]),
        "misshaped": lambda t: t.__setitem__(names["enorm"], torch.ones(3)),
        "block": lambda t: t.__setitem__(names["block"] + "post_attention_layernorm.weight", torch.ones(5)),
    }
    _broken(root, tmp_path / f"broken-{case}", changes[case])
    with pytest.raises(InputError) as err:
        export_model(tmp_path / f"broken-{case}", tmp_path / f"out-{case}", target="ort", families=_registry(model))
    message = str(err.value)
    assert "\n" not in message and "--no-mtp" in message, message
    assert {"missing": names["proj"], "misshaped": "shape [3]", "block": "post_attention_layernorm"}[case] in message
    assert not (tmp_path / f"out-{case}").exists()


def test_a_config_that_declares_mtp_without_its_tensors_exports_the_target(tmp_path) -> None:
    from kvforge.exporter.export import export_model
    from kvforge.tools.coverage_fixtures import build_tiny

    model = build_tiny("glm4_moe", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    said: list[str] = []
    manifest = export_model(tmp_path / "hf", tmp_path / "out", target="ort", families=_registry(model),
                            progress=said.append)
    assert "draft" not in manifest
    assert any("ships none of their tensors" in line for line in said)
