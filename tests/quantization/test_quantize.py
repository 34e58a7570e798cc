"""Weight-only int4 / int8 exports (ONNX Runtime's MatMulNBits quantiser): graphs, manifest, parity gate."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.exporter.export import export_model  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.tools import parity as parity_module  # noqa: E402
from kvforge.tools.parity import run_parity  # noqa: E402
from kvforge.tools.quant_accuracy import measure_quantized  # noqa: E402

RECIPE = "llama3-tiny"  # tied embeddings: the lm_head is the transposed embedding
LAYERS, HIDDEN, VOCAB = 2, 64, 512  # the recipe's (models/recipes.py _TINY); checked below


@pytest.fixture(scope="module")
def quantized(hf_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    made = {}

    def get(bits: str, **options):
        key = (bits, tuple(sorted(options.items())))
        if key not in made:
            out = root / f"{bits}-{len(made)}"
            export_model(hf_folder(RECIPE), out, quantize=bits, **{"quant_method": "rtn", **options})
            made[key] = out
        return made[key]

    return get


def _ops(folder, phase="decode"):
    model = onnx.load(str(folder / f"{phase}.onnx"), load_external_data=False)
    return Counter(node.op_type for node in model.graph.node), model


ALL = {"int4": {"lm_head_bits": 4}, "int8": {}}  # every weight at the --quantize bits (a small model's int4 default
# keeps the lm_head at 8 bits: test_a_small_models_int4_keeps_an_8_bit_lm_head_by_default)


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_quantized_export_has_no_fp32_matmul_and_records_its_cost(bits: str, quantized) -> None:
    folder = quantized(bits, **ALL[bits])
    ops, model = _ops(folder)
    assert ops["MatMul"] == 0 and ops["MatMulNBits"] > 0  # the lm_head too
    assert {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"} == {int(bits[3:])}
    assert "accuracy" not in json.loads((folder / "kvforge.json").read_text())["quantization"]
    measured = measure_quantized(folder)  # what `kvforge export --quantize` runs after the export
    manifest = json.loads((folder / "kvforge.json").read_text())
    quant = manifest["quantization"]
    assert quant["bits"] == int(bits[3:]) and quant["block_size"] == 32
    # The tied embedding is looked up in the lm_head's own quantised table (no copy, no fp32 table).
    assert quant["embedding_quantized"] and quant["embedding_shares_lm_head"]
    lookup = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    reshape = next(n for n in model.graph.node if n.output[0] == lookup.input[0])
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.output[0] == model.graph.output[0].name
                or n.op_type == "MatMulNBits" and "lm_head" in n.input[1])
    assert reshape.op_type == "Reshape" and reshape.input[0] == head.input[1] and lookup.input[2] == head.input[2]
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names)) and not any(list(t.dims) == [VOCAB, HIDDEN] for t in model.graph.initializer)
    # q/k/v and gate/up each run as one MatMulNBits (each quantises its input once): 4 per layer + lm_head.
    assert ops["MatMulNBits"] == 4 * LAYERS + 1 and ops["Split"] == LAYERS
    accuracy = quant["accuracy"]  # against HF eager fp32
    assert accuracy == measured
    load_manifest(folder, verify_hashes=True)  # the recorded measurement leaves a valid export
    steps = int(accuracy["greedy_agreement"].split("/")[1])
    assert steps == 3 * 32
    assert accuracy["perplexity"] > 0 and accuracy["reference_perplexity"] > 0


def test_quantized_weights_are_smaller(quantized, exported) -> None:
    fp32 = json.loads((exported(RECIPE, "ort") / "kvforge.json").read_text())["weights_sharing"]["weights_bytes"]
    for bits, most in (("int4", 0.35), ("int8", 0.6)):
        assert json.loads((quantized(bits, **ALL[bits]) / "kvforge.json").read_text())["quantization"]["weights_bytes"] < most * fp32


def test_a_small_models_int4_keeps_an_8_bit_lm_head_by_default(quantized) -> None:
    quant = json.loads((quantized("int4") / "kvforge.json").read_text())["quantization"]
    assert quant["lm_head_bits"] == 8 and "the default for models under 1B parameters" in quant["lm_head_bits_default"]
    assert "lm_head_bits_default" not in json.loads((quantized("int4", lm_head_bits=4) / "kvforge.json")
                                                    .read_text())["quantization"]


def test_int4_with_an_int8_lm_head(quantized) -> None:
    folder = quantized("int4", lm_head_bits=8)
    _, model = _ops(folder)
    bits = Counter(a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits")
    assert bits[8] == 1 and bits[4] > 1
    assert json.loads((folder / "kvforge.json").read_text())["quantization"]["lm_head_bits"] == 8


@pytest.mark.parametrize("lm_head_bits", [4, 8])
def test_hqq_export_records_its_method_and_keeps_int4_parity(lm_head_bits, quantized, hf_folder) -> None:
    folder = quantized("int4", quant_method="hqq", lm_head_bits=lm_head_bits)
    ops, model = _ops(folder)
    fours = 4 * LAYERS + (lm_head_bits == 4)
    assert ops["MatMulNBits"] == 4 * LAYERS + 1
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    bits = Counter(a.i for n in nodes for a in n.attribute if a.name == "bits")
    assert bits == ({4: 4 * LAYERS, 8: 1} if lm_head_bits == 8 else {4: 4 * LAYERS + 1})
    # HQQ's blocks are asymmetric with float zero points; each 4-bit product runs on the integer kernel (no zero
    # point input: the default 8) with its blocks' offsets added beside it (exporter/quantization/float_offsets.py).
    four = [n for n in nodes if any(a.name == "bits" and a.i == 4 for a in n.attribute)]
    assert all(len(n.input) == 3 for n in four)
    assert ops["ReduceSum"] == ops["MatMul"] == fours and ops["Add"] >= fours
    assert all(any(a.name == "accuracy_level" and a.i == 4 for a in n.attribute) for n in nodes)
    quant = json.loads((folder / "kvforge.json").read_text())["quantization"]
    assert quant["quant_method"] == "hqq" and "HQQ" in quant["method"] and quant["lm_head_bits"] == lm_head_bits
    assert quant["float_zero_points_as_offsets"] == fours and quant["matmuls_left_fp32"] == 0
    # HQQ leaves a Gather alone: the tied embedding shares an 8-bit (rounded) lm_head's table, else stays fp32.
    assert quant["embedding_shares_lm_head"] == (lm_head_bits == 8)
    load_manifest(folder, verify_hashes=True)
    report = run_parity(hf_folder(RECIPE), folder, new_tokens=8, perplexity_tokens=200)
    assert report.perplexity["tolerance"] == 0.30  # the int4 gate, as for rounding
    assert report.passed, report.failure_reason()


def test_rtn_is_recorded(quantized) -> None:
    quant = json.loads((quantized("int4") / "kvforge.json").read_text())["quantization"]
    assert quant["quant_method"] == "rtn" and "symmetric" in quant["method"] and "float_zero_points_as_offsets" not in quant


def test_hqq_is_the_default_for_a_small_fp32_model_and_says_why(hf_folder, tmp_path, monkeypatch) -> None:
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantizer

    # HQQ runs on one torch thread (more only wait on each other on a busy CPU, issue 53) and puts it back
    threads, fit = [], HQQWeightOnlyQuantizer.quantize_internal
    monkeypatch.setattr(HQQWeightOnlyQuantizer, "quantize_internal",
                        lambda self, *a, **k: threads.append(torch.get_num_threads()) or fit(self, *a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    messages = []
    try:
        manifest = export_model(hf_folder(RECIPE), tmp_path / "out", quantize="int4", progress=messages.append)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert threads and set(threads) == {1}
    counted = [m for m in messages if m.startswith("HQQ: matrix ")]
    assert counted[0].startswith(f"HQQ: matrix 1 of {4 * LAYERS}") and counted[-1] == f"HQQ: matrix {4 * LAYERS} of {4 * LAYERS}"
    quant = manifest["quantization"]
    assert quant["quant_method"] == "hqq" and quant["quant_method_default"].startswith("hqq: int4 fitted with HQQ")
    assert any("HQQ, ONNX Runtime's MatMulNBits" in m and "; hqq: int4 fitted with HQQ, the default under 1B" in m
               for m in messages)  # the console says why, not only the manifest
    assert quant["float_zero_points_as_offsets"] == 4 * LAYERS


def test_quant_method_on_the_command_line(tmp_path) -> None:
    from click.testing import CliRunner

    from kvforge.cli import export_kind, main

    result = CliRunner().invoke(main, ["export", "--recipe", RECIPE, "-o", str(tmp_path / "out"), "--quantize", "int8",
                                       "--quant-method", "hqq"])
    assert result.exit_code != 0 and "--quant-method hqq takes --quantize int4 only" in result.output
    assert not (tmp_path / "out").exists()
    manifest = {"target": "ort", "dtype": "fp32", "quantization": {"bits": 4, "lm_head_bits": 8, "quant_method": "hqq"}}
    assert export_kind(manifest) == "ort, fp32, int4 weights (hqq), 8-bit lm_head"


def test_accuracy_level_on_the_command_line_reaches_every_matmulnbits(tmp_path) -> None:
    import onnx
    from click.testing import CliRunner

    from kvforge.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--recipe", RECIPE, "-o", str(out), "--quantize", "int4", "--quant-method", "rtn",
                                       "--accuracy-level", "1"])
    assert result.exit_code == 0, result.output
    nodes = [n for n in onnx.load(out / "prefill.onnx", load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(any(a.name == "accuracy_level" and a.i == 1 for a in n.attribute) for n in nodes)
    assert json.loads((out / "kvforge.json").read_text())["quantization"]["accuracy_level"] == 1
    bad = CliRunner().invoke(main, ["export", "--recipe", RECIPE, "-o", str(tmp_path / "x"), "--accuracy-level", "7"])
    assert bad.exit_code == 2 and "'--accuracy-level': 7 is not in the range 1<=x<=4" in bad.output


def test_quantized_export_generates_and_parity_gates_on_perplexity(quantized, hf_folder, monkeypatch) -> None:
    folder = quantized("int8")
    result = Generator(folder).generate([[1, 50, 60, 70]], max_new_tokens=8, ignore_eos=True)
    assert len(result.tokens[0]) == 8
    report = run_parity(hf_folder(RECIPE), folder, new_tokens=8, perplexity_tokens=200)
    assert report.quantization is not None and report.perplexity is not None
    rise = report.perplexity["export"] / report.perplexity["hf"] - 1
    assert report.perplexity["tolerance"] == 0.02
    assert report.passed == (rise <= 0.02), report.failure_reason()
    assert "gated on perplexity only" in report.summary()
    # The gate can fail: with no rise allowed, the (non-zero) quantisation error fails it.
    monkeypatch.setitem(parity_module.QUANTIZED_PERPLEXITY_RISE, 8, -1.0)
    strict = run_parity(hf_folder(RECIPE), folder, new_tokens=4, perplexity_tokens=200)
    assert not strict.passed
    assert "8-bit export's is" in strict.failure_reason() and "more than the -100% allowed" in strict.failure_reason()
    with pytest.raises(InputError, match="its parity gate is perplexity, so --perplexity-tokens must be at least 2"):
        run_parity(hf_folder(RECIPE), folder, perplexity_tokens=0)


def test_quantized_logits_are_close_to_fp32(quantized, exported) -> None:
    # int8 weights: logits within a few percent of the fp32 export's range on one prefill.
    ids = [[1, 50, 60, 70, 80, 90]]
    fp32 = Generator(exported(RECIPE, "ort")).generate(ids, max_new_tokens=1, keep_logits=True).logits[0]
    int8 = Generator(quantized("int8")).generate(ids, max_new_tokens=1, keep_logits=True).logits[0]
    spread = float(fp32.max() - fp32.min())
    assert np.abs(int8 - fp32).max() < 0.05 * spread


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(quantize="int3"), "--quantize takes int4, int8, not 'int3'"),
        (dict(quantize="int4", block_size=48), "--block-size takes 16, 32, 64, 128, not 48"),
        (dict(quantize="int4", dtype="fp16", quant_method="hqq"), "--quant-method hqq runs with fp32 activations only"),
        (dict(quantize="int4", target="onnx"), "use it with --target ort, not onnx"),
        (dict(lm_head_bits=8), "--lm-head-bits goes with --quantize"),
        (dict(quantize="int4", lm_head_bits=2), "--lm-head-bits takes 8"),
        (dict(quantize="int4", quant_method="gptq"), "--quant-method takes rtn, hqq, autoround, not 'gptq'"),
        (dict(quant_method="hqq"), "--quant-method hqq goes with --quantize int4"),
        (dict(quantize="int8", quant_method="hqq"), "--quant-method hqq takes --quantize int4 only"),
        (dict(quantize="int4", accuracy_level=0), "--accuracy-level takes 1 (fp32), 2 (fp16), 3 (bf16), 4 (int8), not 0"),
        (dict(accuracy_level=1), "--accuracy-level goes with --quantize"),
    ],
)
def test_quantize_option_errors(options, message, hf_folder, tmp_path) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_model(hf_folder(RECIPE), tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_recipe_shape_constants(hf_folder) -> None:
    config = json.loads((hf_folder(RECIPE) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (LAYERS, HIDDEN, VOCAB)


def _tied_model(vocab: int = 64, hidden: int = 64):
    """ids -> Gather(W) -> MatMul(., Transpose(W)): a tied embedding and lm_head, seeded weights."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).normal(size=(vocab, hidden)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["W", "ids"], ["h"], name="embed"),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Wt"], ["logits"], name="lm_head")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", vocab]),
                               helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "s", hidden])],
                              initializer=[numpy_helper.from_array(weight, "W")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ir.from_proto(proto), weight


def _run(model, ids):
    import onnx_ir as ir
    import onnxruntime as ort

    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits", "h"], {"ids": ids})


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_tied_embedding_reads_the_lm_heads_table(bits, monkeypatch) -> None:
    from kvforge.exporter.quantization import matmuls as quantize_module

    ids = np.arange(64, dtype=np.int64)[None]
    model, weight = _tied_model()
    shared, record = quantize_module.quantize_model(model, bits, 32, vocab_size=64)
    assert record["embedding_shares_lm_head"] and Counter(n.op_type for n in shared.graph)["GatherBlockQuantized"] == 1
    _, embedded = _run(shared, ids)
    # The lookup gives the lm_head's own dequantised rows: multiples of its block scales, within a step
    # of the fp32 weights (half a step, or one where the quantiser's asymmetric range clips).
    head = next(n for n in shared.graph if n.op_type == "MatMulNBits")
    step = np.abs(head.inputs[2].const_value.numpy()).reshape(64, -1, 1)  # the quantiser signs its scales
    units = embedded[0].reshape(64, -1, 32) / step
    assert np.allclose(units, np.round(units), atol=1e-3)
    assert np.all(np.abs(embedded[0] - weight).reshape(64, -1, 32) <= step + 1e-6)
    # What ONNX Runtime's quantiser alone makes of the lookup: int4 its own 4-bit copy with the very same
    # values, int8 a fp32 table.
    import onnx_ir as ir

    alone = _tied_model()[0]
    quantize_module._materialise_transposed_weights(alone)
    apart = ir.from_proto(quantize_module._run_quantizer(ir.to_proto(alone), int(bits[3:]), 32, 4))
    assert Counter(n.op_type for n in apart.graph)["GatherBlockQuantized"] == (bits == "int4")
    _, embedded_apart = _run(apart, ids)
    # With the sharing switched off the tied lookup keeps the fp32 table (quantize_model keeps it from the quantiser).
    monkeypatch.setattr(quantize_module, "share_tied_embedding", lambda model, tied: 0)
    fp32_lookup, record = quantize_module.quantize_model(_tied_model()[0], bits, 32, vocab_size=64)
    assert not record["embedding_shares_lm_head"]
    assert np.array_equal(_run(fp32_lookup, ids)[1][0], weight)
    if bits == "int4":
        assert np.array_equal(embedded_apart, embedded)
    else:
        assert np.array_equal(embedded_apart[0], weight) and not np.array_equal(embedded, embedded_apart)
