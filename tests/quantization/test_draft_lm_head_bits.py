"""`--draft-lm-head-bits` (exporter/quantization/draft_lm_head.py): draft.onnx's lm_head as a MatMulNBits block-quantised matrix.

One export of conftest's tiny DeepSeek-V3 checkpoint with its MTP layer (mtp_export, shared with the other head
tests) at 8 bits: the head's logits MatMul is MatMulNBits and no float vocabulary matrix is left; its logits stay
close to the fp32 head's (bounds below, measured against what rounding can do); greedy speculation through the
Generator still equals plain greedy; the manifest and `kvforge inspect` say the bits; a target other than ort,
bits other than 4 or 8, and an export without a head are refused in one line with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from head_exports import BoundHead

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402

pytestmark = pytest.mark.xdist_group("mtp")

FAMILY = "deepseek_v3"
CAPACITY = 32
# Measured (8-bit blocks of 32, accuracy level 4, the fixture's random head, 16 positions, 3 seeds): max |diff|
# 0.048-0.056 over a logit range of 12.1-12.7 (0.40-0.44%), argmax equal on 16 of 16. The bound is ~5x that;
# 4-bit blocks already give 4.3-5.7% (and 81-100% argmax agreement), and a wrong scale, block layout or a
# transposed matrix gives differences of the range's order.
MAX_DIFF_OF_RANGE = 0.02
MIN_ARGMAX_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def quantised(mtp_export, tmp_path_factory):
    """(root, the 8-bit export): root/hf the tiny checkpoint, root/mtp its fp32-head export (read-only)."""
    from head_exports import mtp_registry

    from kvforge.exporter.export import export_model

    root = mtp_export(FAMILY)
    out = tmp_path_factory.mktemp("draft-lm8") / "mtp8"
    export_model(root / "hf", out, target="ort", families=mtp_registry(root / "hf"), draft_lm_head_bits=8)
    return root, out


def _vocab_matmuls(path, vocab: int) -> tuple[list, list]:
    """(float MatMuls whose constant weight has a vocabulary-sized dimension, MatMulNBits nodes of N = vocab)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    floats = [n for n in graph.node if n.op_type == "MatMul" and vocab in shapes.get(n.input[1], [])]
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"
             and {a.name: a.i for a in n.attribute}.get("N") == vocab]
    return floats, nbits


def test_the_lm_head_is_matmulnbits_and_the_manifest_says_so(quantised) -> None:
    root, out = quantised
    manifest = load_manifest(out)
    vocab = manifest["model"]["vocab_size"]
    floats, nbits = _vocab_matmuls(out / "draft.onnx", vocab)
    assert not floats and len(nbits) == 1
    attributes = {a.name: a.i for a in nbits[0].attribute}
    assert (attributes["bits"], attributes["block_size"], attributes["accuracy_level"]) == (8, 32, 4)
    assert manifest["draft"]["lm_head_bits"] == 8 and manifest["draft"]["lm_head_block_size"] == 32
    # The fp32 head's export: a float lm_head, no bits recorded (old records read as before).
    plain_floats, plain_nbits = _vocab_matmuls(root / "mtp" / "draft.onnx", vocab)
    assert len(plain_floats) == 1 and not plain_nbits and "lm_head_bits" not in load_manifest(root / "mtp")["draft"]


def test_the_logits_stay_close_to_the_fp32_heads(quantised) -> None:
    from head_exports import load_hf

    root, out = quantised
    model = load_hf(root / "hf")
    import torch

    ids = [int(t) for t in np.random.default_rng(3).integers(3, 500, size=17)]
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    zeros = np.zeros((16, model.config.hidden_size), np.float32)
    fp32, _, _ = BoundHead(root / "mtp", CAPACITY)(0, ids[1:], states[:16], zeros)
    q8, _, _ = BoundHead(out, CAPACITY)(0, ids[1:], states[:16], zeros)
    spread = float(fp32.max() - fp32.min())
    worst = float(np.abs(q8 - fp32).max())
    agreement = float((q8.argmax(-1) == fp32.argmax(-1)).mean())
    assert 0 < worst <= MAX_DIFF_OF_RANGE * spread, (worst, spread)  # > 0: the matrix really is quantised
    assert agreement >= MIN_ARGMAX_AGREEMENT, agreement


def test_greedy_speculation_keeps_plain_greedy_output(quantised) -> None:
    from kvforge.runtime import Generator

    generator = Generator(quantised[1])
    prompts = [[1, 17, 230, 41, 9, 77, 12], [1, 300, 2, 301, 44, 45, 46, 47, 48]]
    for prompt in prompts:
        plain = generator.generate([prompt], max_new_tokens=16, greedy=True, ignore_eos=True)
        spec = generator.generate([prompt], max_new_tokens=16, greedy=True, ignore_eos=True, speculate="mtp",
                                  draft_len=3)
        assert spec.tokens == plain.tokens and spec.draft_tokens > 0


def test_inspect_names_the_bits(quantised) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    shown = CliRunner().invoke(main, ["inspect", str(quantised[1])])
    assert shown.exit_code == 0, shown.output
    assert "  speculation head: MTP layer 1 of 1, 8-bit lm_head, in draft.onnx (--speculate mtp)" in \
        shown.output.splitlines()


@pytest.mark.parametrize(("options", "message"), [
    ({"target": "onnx", "draft_lm_head_bits": 8},
     "--draft-lm-head-bits goes with --target ort (ONNX Runtime's MatMulNBits), not onnx"),
    ({"draft_lm_head_bits": 3}, "--draft-lm-head-bits takes 4 or 8, not 3"),
    ({"draft_lm_head_bits": 8, "mtp": False},
     "--draft-lm-head-bits needs a head: --eagle HEAD_DIR or a checkpoint's MTP layer"),
])
def test_refusals_are_one_line_and_write_nothing(mtp_export, tmp_path, options, message) -> None:
    from head_exports import mtp_registry

    from kvforge.exporter.export import export_model

    root = mtp_export(FAMILY)
    with pytest.raises(InputError) as err:
        export_model(root / "hf", tmp_path / "out", families=mtp_registry(root / "hf"), **options)
    assert str(err.value) == message
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_another_target(mtp_export, tmp_path) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    root = mtp_export(FAMILY)
    result = CliRunner().invoke(main, ["export", str(root / "hf"), "-o", str(tmp_path / "out"), "--target", "onnx",
                                       "--draft-lm-head-bits", "8"])
    assert result.exit_code == 2, result.output
    assert "--draft-lm-head-bits goes with --target ort" in result.output
    assert not (tmp_path / "out").exists()


def test_the_manifest_check_takes_old_and_new_records_and_refuses_other_bits(quantised) -> None:
    import copy

    from kvforge.core.contract import KVLayout
    from kvforge.core.draft_manifest import check_draft
    from kvforge.core.errors import ManifestError

    out = quantised[1]
    manifest = load_manifest(out)
    layout = KVLayout.from_manifest(manifest)
    old = copy.deepcopy(manifest)
    del old["draft"]["lm_head_bits"], old["draft"]["lm_head_block_size"]
    for record in (manifest, old):
        check_draft(record, out, layout)
    bad = copy.deepcopy(manifest)
    bad["draft"]["lm_head_bits"] = 5
    with pytest.raises(ManifestError, match=r"draft.lm_head_bits is 5, not 4 or 8 with an integer"):
        check_draft(bad, out, layout)
