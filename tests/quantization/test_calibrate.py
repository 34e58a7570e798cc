"""Calibrated int4 (--quant-method autoround, issue 44, 1): AutoRound's integers carried into MatMulNBits with
integer zero points, one progress line a block, its work folder gone afterwards; --calibration FILE checked
(empty, binary, too short: one line, exit 2, nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("auto_round")

from kvforge.cli import main  # noqa: E402

pytestmark = pytest.mark.xdist_group("prequantized")


def test_autoround_carries_its_integers_with_zero_points_and_says_each_block(hf_folder, tmp_path, monkeypatch):
    import onnx

    from kvforge.exporter.export import export_model
    from kvforge.exporter.quantization import autoround as calibrate

    monkeypatch.setattr(calibrate, "ITERATIONS", 20)  # the method, not its full tuning: seconds, not a minute
    said = []
    manifest = export_model(hf_folder("llama-tiny"), tmp_path / "out", quantize="int4", quant_method="autoround",
                            progress=said.append)
    quant = manifest["quantization"]
    assert quant["quant_method"] == "autoround" and quant["lm_head_bits"] == 8
    assert quant["integer_weights"] == {"source": "AutoRound calibration", "carried_over": 4 * 2,
                                        "rounded": ["lm_head.weight"]}
    blocks = [line for line in said if line.startswith("calibrating: ")]
    assert blocks[0] == "calibrating: model.layers.0 (1 of 2)"
    assert blocks[1].startswith("calibrating: model.layers.1 (2 of 2; about ") and blocks[1].endswith(" left)")
    # The start line gives the docs' measured figure, and an estimate follows the first tuning steps (issue 53)
    assert any("docs/quantisation.md measured 10-14 minutes" in line for line in said)
    estimate = [line for line in said if line.startswith("AutoRound's tuning steps take ")]
    assert len(estimate) == 1 and "for the 2 blocks' 20 steps" in estimate[0], said
    assert said.index(estimate[0]) < said.index(blocks[1])  # within the first block, not after it
    assert not (tmp_path / ".out.calibration").exists()
    graph = onnx.load(str(tmp_path / "out" / "prefill.onnx"), load_external_data=False).graph
    four = [n for n in graph.node if n.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 4 for a in n.attribute)]
    assert len(four) == 8 and all(len(n.input) == 4 and n.input[3] for n in four)  # asymmetric: integer zero points


def test_autoround_is_closer_to_fp32_than_rounding(hf_folder, tmp_path, monkeypatch):
    """On the same tiny model, the calibrated integers' logits are nearer the fp32 model's than RTN's."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.export import export_model
    from kvforge.exporter.quantization import autoround as calibrate
    from kvforge.runtime import GenerationRequest, Generator

    monkeypatch.setattr(calibrate, "ITERATIONS", 50)
    base = hf_folder("qwen2-tiny")
    errors = {}
    text = (calibrate.CALIBRATION_TEXT.read_text())
    ids = [int(i) % 500 + 3 for i in np.frombuffer(text[:64].encode(), np.uint8)][:40]
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    for method in ("rtn", "autoround"):
        export_model(base, tmp_path / method, quantize="int4", quant_method=method, lm_head_bits=8, accuracy_level=1)
        result = Generator(tmp_path / method).generate(GenerationRequest([ids], 1, keep_logits=True))
        scores = Generator(tmp_path / method).score(ids)
        errors[method] = float(-scores.mean())
        assert result.tokens
    with torch.no_grad():
        fp32 = float(-torch.log_softmax(torch.tensor(expected[:-1]), -1).gather(1, torch.tensor(ids[1:])[:, None]).mean())
    assert abs(errors["autoround"] - fp32) < abs(errors["rtn"] - fp32)


@pytest.mark.parametrize("content, said", [
    (b"", "is empty: give a text file of at least 512 tokens"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "is not UTF-8 text (a binary file?): give plain text"),
    (b"hello\x00world " * 10, "holds NUL bytes (a binary file?): give plain text"),
    (b"A short note about the weather. " * 5, "tokens; calibration needs at least 512"),
], ids=["empty", "binary", "nul", "too-short"])
def test_a_calibration_file_that_cannot_calibrate_is_one_line_and_exit_2(content, said, hf_folder, tmp_path):
    calibration = tmp_path / "calibration.txt"
    calibration.write_bytes(content)
    result = CliRunner().invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "out"), "--quantize",
                                       "int4", "--quant-method", "autoround", "--calibration", str(calibration)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert len(errors) == 1 and said in errors[0] and "--calibration " in errors[0], result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.calibration").exists()


def test_calibration_goes_with_autoround(hf_folder, tmp_path):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("text " * 600)
    result = CliRunner().invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "out"), "--quantize",
                                       "int4", "--quant-method", "rtn", "--calibration", str(calibration)])
    assert result.exit_code == 2 and "--calibration goes with --quant-method autoround, not rtn" in result.stderr


def test_int4_without_a_method_calibrates_a_small_fp16_model_and_says_why(hf_folder, tmp_path, monkeypatch):
    from kvforge.exporter.export import export_model
    from kvforge.exporter.quantization import autoround as calibrate

    monkeypatch.setattr(calibrate, "ITERATIONS", 5)
    manifest = export_model(hf_folder("llama-tiny"), tmp_path / "out", quantize="int4", dtype="fp16")
    quant = manifest["quantization"]
    assert quant["quant_method"] == "autoround" and quant["quant_method_default"].startswith("autoround: calibrated")
    assert "with --dtype fp16" in quant["quant_method_default"]
    assert quant["integer_weights"]["carried_over"] == 8
