"""The canonical mixture-of-experts node (plugins/moe_op.py): HF's experts modules in its layout give
their own outputs, and both lowerings (ONNX Runtime's MoE, plain ONNX) compute the node's reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvforge.exporter import experts_routing  # noqa: E402
from kvforge.exporter.quantization import experts as experts_int4  # noqa: E402
from kvforge.exporter.targets import moe_ort, moe_plain  # noqa: E402
from kvforge.models.families import family_modules  # noqa: E402
from kvforge.models.families.surgery import Patches  # noqa: E402
from kvforge.tools.coverage_fixtures import build_tiny  # noqa: E402


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_hf_experts_through_the_node_give_their_own_output(model_type: str, tmp_path) -> None:
    # qwen3_moe: concatenated [gate; up], SiLU gating. gpt_oss: interleaved, transposed, biased,
    # clamped (up + 1) gating. The node's layout and activation must reproduce each exactly.
    model = build_tiny(model_type, tmp_path / "hf")
    modules = _experts_modules(model)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, model.config.hidden_size, generator=generator) * 3.0
    k = model.config.num_experts_per_tok
    experts = modules[0].num_experts
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(7)])
    weights = torch.rand(7, k, generator=generator)  # not normalised: the sum matters
    with torch.no_grad():
        for module in modules:
            for param in module.parameters():
                param.normal_(0.0, 0.5, generator=generator)  # big enough for gpt-oss's clamp to bite
        model.set_experts_implementation("batched_mm")
        theirs = [module(hidden, index, weights) for module in modules]
        counts = experts_routing.prepare_experts(model, Patches())
        ours = [module(hidden, index, weights) for module in modules]
    assert counts == {"node": len(modules), "batched_mm": 0}
    # Each module now holds its experts once: the node's layout only.
    assert not any(name in ("gate_up_proj", "down_proj") for module in modules for name, _ in
                   module.named_parameters(recurse=False))
    for mine, reference in zip(ours, theirs, strict=True):
        # fp32 sums in another order (transformers 5.24's batched_mm for gpt-oss) differ by ~2e-5 relative
        # at these magnitudes; a wrong layout or activation differs by O(1).
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["dbrx", "longcat_flash"])
def test_looped_experts_through_the_node_give_their_own_output(model_type: str, tmp_path) -> None:
    # Experts modules written as a loop over the picked experts, in their own layouts: DBRX's flat w1 / v1 / w2
    # (w2 applied transposed), LongCat-Flash's [gate; up] with zero-computation identity experts past the routed
    # ones (ids >= n_routed_experts: output = input). Every token below picks one identity expert or more.
    model = build_tiny(model_type, tmp_path / "hf")
    family = family_modules()[model_type]
    modules = [m for m in model.modules() if family.looped_experts(m) is not None]
    generator = torch.Generator().manual_seed(1)
    tokens, k = 7, 2
    hidden = torch.randn(tokens, model.config.hidden_size, generator=generator) * 3.0
    if model_type == "dbrx":
        index = torch.stack([torch.randperm(modules[0].num_experts, generator=generator)[:k] for _ in range(tokens)])
    else:
        routed, total = modules[0].num_routed_experts, modules[0].total_experts
        identity = torch.randint(routed, total, (tokens, 1), generator=generator)
        index = torch.cat([identity, torch.randint(0, routed, (tokens, 1), generator=generator)], dim=1)
        index[0] = torch.tensor([routed, routed + 1])  # identity experts only
    weights = torch.rand(tokens, k, generator=generator)
    with torch.no_grad():
        theirs = [module(hidden, index, weights) for module in modules]
        assert experts_routing.prepare_looped_experts(model, family, Patches()) == len(modules) > 0
        ours = [module(hidden, index, weights) for module in modules]
    assert not any(True for module in modules for _ in module.parameters())  # the node's copies only
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)


def test_a_gate_the_node_does_not_model_keeps_the_gather_form(tmp_path) -> None:
    model = build_tiny("qwen3_moe", tmp_path / "hf")
    for module in _experts_modules(model):
        module.act_fn = torch.nn.GELU()  # not SwiGLU
    assert experts_routing.prepare_experts(model, Patches()) == {"node": 0, "batched_mm": len(_experts_modules(model))}


@pytest.mark.parametrize("lowering", ["lower_moe_to_ort", "lower_moe_to_plain"])
@pytest.mark.parametrize("form", [(1.0, 0.0, 0.0, False), (1.702, 1.0, 7.0, True)], ids=["silu", "gpt-oss"])
def test_each_lowering_computes_the_node(lowering: str, form, tmp_path) -> None:
    # Routing weights that do not sum to 1 (ONNX Runtime's MoE routes by itself: the lowering hands it
    # log-weights and scales back), picks with weight 0, biases and the clamp.
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from kvforge.plugins.moe_op import CUSTOM_TRANSLATION_TABLE

    alpha, beta, limit, biased = form
    generator = torch.Generator().manual_seed(2)
    experts, hidden_size, inter, k, tokens = 6, 32, 24, 2, 5
    gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=generator) * 0.5
    down = torch.randn(experts, hidden_size, inter, generator=generator) * 0.5
    biases = (torch.randn(experts, 2 * inter, generator=generator), torch.randn(experts, hidden_size,
                                                                              generator=generator))
    biases = biases if biased else (None, None)

    class Experts(torch.nn.Module):
        def forward(self, hidden, index, weights):
            return torch.ops.kvforge.moe_experts(hidden, index, weights, gate_up, down, *biases, alpha, beta, limit)

    hidden = torch.randn(tokens, hidden_size, generator=generator) * 2.0
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator) * 1.5
    weights[3, 1] = 0.0
    # What an identity expert's pick becomes (experts_routing._looped_forward): a routed expert at weight 0, every pick of
    # a token (row 2), or the same expert as the token's other pick (row 4).
    weights[2] = 0.0
    index[4, 1], weights[4, 1] = index[4, 0], 0.0
    with torch.no_grad():
        want = Experts()(hidden, index, weights).numpy()
        program = torch.onnx.export(Experts(), (hidden, index, weights), dynamo=True, opset_version=24,
                                    custom_translation_table=CUSTOM_TRANSLATION_TABLE, optimize=False, verbose=False)
    model = program.model
    lowerings = {"lower_moe_to_ort": moe_ort.lower_moe_to_ort, "lower_moe_to_plain": moe_plain.lower_moe_to_plain}
    assert lowerings[lowering](model.graph) == 1
    model.graph.opset_imports.pop("kvforge", None)
    ir.save(model, tmp_path / "moe.onnx")
    session = ort.InferenceSession(str(tmp_path / "moe.onnx"), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], (hidden.numpy(), index.numpy(), weights.numpy()),
                     strict=True))
    got = session.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    ops = {node.op_type for node in model.graph}
    assert ("MoE" in ops) == (lowering == "lower_moe_to_ort")


def _dequantize(packed, scales, bits: int, block_size: int):
    import numpy as np

    if bits == 4:  # two values per byte, the first in the low nibble
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    else:
        values = packed
    offset = 2 ** (bits - 1)
    experts, rows, cols = values.shape
    blocks = (values.astype(np.float32) - offset).reshape(experts, rows, cols // block_size, block_size)
    return (blocks * scales[..., None]).reshape(experts, rows, cols)


def test_int4_experts_are_what_qmoe_computes(tmp_path) -> None:
    # `--quantize int4` on `ort`: the experts become ONNX Runtime's QMoE, their weights quantised by ONNX
    # Runtime's own MatMulNBits quantiser. QMoE must compute the node with the dequantised weights
    # (layout, nibble order, offset and the quantiser's signed scales all agree), and those must be
    # within one quantisation step of the float weights.
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from kvforge.exporter.quantization.experts import quantize_experts
    from kvforge.plugins.moe_op import CUSTOM_TRANSLATION_TABLE

    bits = 4
    generator = torch.Generator().manual_seed(3)
    experts, hidden_size, inter, k, tokens, block = 4, 64, 32, 2, 6, 32
    gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=generator) * 0.3
    down = torch.randn(experts, hidden_size, inter, generator=generator) * 0.3
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator)

    def node(up, dn):
        class Experts(torch.nn.Module):
            def forward(self, hidden, index, weights):
                return torch.ops.kvforge.moe_experts(hidden, index, weights, up, dn, None, None, 1.0, 0.0, 0.0)
        return Experts()

    deq = [torch.from_numpy(_dequantize(*quantize_experts(w.numpy(), bits, block), bits, block))
           for w in (gate_up, down)]
    assert all(float((d - w).abs().max()) <= float(w.abs().max()) / 2 ** (bits - 1)
               for d, w in zip(deq, (gate_up, down), strict=True))
    with torch.no_grad():
        want = node(*deq)(hidden, index, weights).numpy()
        program = torch.onnx.export(node(gate_up, down), (hidden, index, weights), dynamo=True, opset_version=24,
                                    custom_translation_table=CUSTOM_TRANSLATION_TABLE, optimize=False, verbose=False)
    model = program.model
    assert moe_ort.lower_moe_to_ort(model.graph, (bits, block)) == 1
    assert [n.op_type for n in model.graph if n.domain == "com.microsoft"] == ["QMoE"]
    model.graph.opset_imports.pop("kvforge", None)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.save(model, tmp_path / "qmoe.onnx")
    session = ort.InferenceSession(str(tmp_path / "qmoe.onnx"), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], (hidden.numpy(), index.numpy(), weights.numpy()),
                     strict=True))
    np.testing.assert_allclose(session.run(None, feeds)[0], want, atol=2e-4, rtol=1e-4)


def test_int8_experts_are_refused_by_the_lowering_saying_why() -> None:
    import onnx_ir as ir

    from kvforge.core.errors import ExportError

    graph = ir.Graph([], [], nodes=[ir.Node("kvforge", "MoEExperts", [None] * 5, attributes=[
        ir.AttrFloat32(name, 0.0) for name in ("activation_alpha", "activation_beta", "swiglu_limit")])])
    with pytest.raises(ExportError, match="8-bit block-wise"):
        moe_ort.lower_moe_to_ort(graph, (8, 32))


def test_int4_export_quantises_the_experts_and_adds_little_error(tmp_path, monkeypatch) -> None:
    # --quantize int4 on a tiny Qwen3-MoE: both graphs run QMoE with no float expert weights left. At this
    # size int4 attention, MLP, embedding and lm_head already move the logits by ~2.5 (against HF eager
    # fp32); quantising the experts too may add little to that (a layout or routing fault in QMoE would
    # add errors of the logits' own size). The yardstick is the same int4 export with fp32 experts.
    import onnx

    from kvforge.exporter.export import export_model
    from kvforge.tools.parity import run_parity

    model = build_tiny("qwen3_moe", tmp_path / "hf")

    def error(out) -> float:
        return run_parity(tmp_path / "hf", out, ["The quick brown fox", "Once upon a time in a land"], 8,
                          atol=100.0, perplexity_tokens=64, hf_model=model).max_abs_err

    calls = []
    quantize_experts = experts_int4.quantize_experts
    monkeypatch.setattr(experts_int4, "quantize_experts", lambda *args: calls.append(args[0].shape) or quantize_experts(*args))
    export_model(tmp_path / "hf", tmp_path / "int4", target="ort", quantize="int4", quant_method="rtn")
    assert len(calls) == 2 * 2  # gate/up and down of each of the 2 layers, once for both graphs
    for name in ("prefill.onnx", "decode.onnx"):
        graph = onnx.load(tmp_path / "int4" / name, load_external_data=False).graph
        assert [n.op_type for n in graph.node if n.op_type in ("MoE", "QMoE")] == ["QMoE"] * 2
        floats = [i.name for i in graph.initializer if len(i.dims) == 3 and i.data_type == onnx.TensorProto.FLOAT]
        assert floats and all(name.endswith("_scales4") for name in floats), floats  # QMoE's scales only
    quantised = error(tmp_path / "int4")
    lower = moe_ort.lower_moe_to_ort
    monkeypatch.setattr(moe_ort, "lower_moe_to_ort", lambda graph, quantize=None: lower(graph))
    export_model(tmp_path / "hf", tmp_path / "float-experts", target="ort", quantize="int4", quant_method="rtn")
    assert quantised < 1.25 * error(tmp_path / "float-experts")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_an_fp16_ort_export_of_moe_loads_and_agrees_with_fp32(model_type: str, tmp_path) -> None:
    # Mixtral's router hands its top-k weights on in fp32 beside fp16 hidden states: ONNX Runtime's MoE takes one
    # type for both, so an export that passed them on as they were could not be loaded at all.
    import numpy as np

    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    build_tiny(model_type, tmp_path / "hf")
    for dtype in ("fp32", "fp16"):
        export_model(tmp_path / "hf", tmp_path / dtype, target="ort", dtype=dtype)
    prompt = [5, 6, 7, 8, 9]
    first = {dtype: Generator(tmp_path / dtype).generate([prompt], max_new_tokens=1, greedy=True, ignore_eos=True,
                                                         keep_logits=True).logits[0][0]  # the prefill's, row 0
             for dtype in ("fp32", "fp16")}
    np.testing.assert_allclose(np.asarray(first["fp16"], np.float32), np.asarray(first["fp32"]), atol=0.05)
