"""What the export writes: graph structure, shared weights, chunked prefill, manifest, errors."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from kvforge.core.errors import ExportError, InputError, UnsupportedModelError  # noqa: E402
from kvforge.core.manifest import load_manifest  # noqa: E402
from kvforge.exporter.export import export_model  # noqa: E402

ATTENTION_OP = {"ort": ("com.microsoft", "GroupQueryAttention"), "onnx": ("", "Attention")}


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_one_fused_attention_node_per_layer_and_no_softmax(target: str, exported) -> None:
    folder = exported("qwen3-tiny", target)
    manifest = load_manifest(folder, verify_hashes=True)
    layers = manifest["kv_cache"]["num_layers"]
    for phase in ("prefill", "decode"):
        graph = onnx.load(folder / f"{phase}.onnx", load_external_data=False).graph
        ops = [(node.domain, node.op_type) for node in graph.node]
        assert ops.count(ATTENTION_OP[target]) == layers
        assert not any(op in ("Softmax", "KVCacheAttention") for _, op in ops)
        assert not any(domain == "kvforge" for domain, _ in ops)
        if target == "onnx":
            assert ops.count(("", "TensorScatter")) == 2 * layers


def test_ort_norms_write_no_training_statistics(exported) -> None:
    """SkipSimplifiedLayerNormalization's mean / inv_std_var outputs are absent (""), so ONNX Runtime
    neither allocates nor writes them per step; the residual sum (output 3) stays where it is used
    (every norm but the last)."""
    folder = exported("llama-tiny", "ort")
    for phase in ("prefill", "decode"):
        graph = onnx.load(folder / f"{phase}.onnx", load_external_data=False).graph
        norms = [node for node in graph.node if node.op_type == "SkipSimplifiedLayerNormalization"]
        assert norms, phase
        consumed = {name for node in graph.node for name in node.input}
        for node in norms:
            outputs = [*node.output, "", "", ""][:4]  # trailing absent outputs may be left out
            assert outputs[1:3] == ["", ""], (phase, outputs)
            assert outputs[0] in consumed
            assert outputs[3] in consumed if node is not norms[-1] else outputs[3] == ""


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_decode_graph_has_no_positions_gather(exported, target: str) -> None:
    """Decode's one position is the only one: the prefill's logits_index gather (and its Unsqueeze /
    Expand / zero index) is dropped from the decode graph, not fed zeros (four nodes a step)."""
    folder = exported("llama-tiny", target)
    ops = {phase: [node.op_type for node in onnx.load(folder / f"{phase}.onnx", load_external_data=False).graph.node]
           for phase in ("prefill", "decode")}
    assert ops["prefill"].count("GatherElements") == 1
    removed = Counter(ops["prefill"]) - Counter(ops["decode"])
    added = Counter(ops["decode"]) - Counter(ops["prefill"])
    # ort: GQA's lengths in decode are past_lens and the cache's capacity (shape ops on the host), where
    # prefill computes them: the Add, Sub and ReduceMax of past_lens + S go, and with them the constant one.
    lengths = Counter({"Add": 1, "Sub": 1, "ReduceMax": 1}) if target == "ort" else Counter()
    assert removed == Counter({"GatherElements": 1, "Unsqueeze": 1, "Expand": 1}) + lengths, removed
    squeeze = Counter({"Squeeze": 1, "Constant": 1 if target == "onnx" else 0})  # logits [B, 1, V] -> [B, V]
    assert added == +squeeze, added


def test_ort_stores_a_tied_lm_head_transposed_once(exported) -> None:
    """A tied lm_head on `ort` is a MatMul over a stored [H, V] table, not Transpose(embedding) (which ONNX
    Runtime runs as FusedMatMul transB, slower, or folds at every session start); the embedding looks its rows
    up as that table's columns, so the table is stored once. `onnx` keeps the [V, H] table and the Transpose."""
    for target, stored in (("ort", True), ("onnx", False)):
        graph = onnx.load(exported("qwen2-tiny", target) / "prefill.onnx", load_external_data=False).graph
        shapes = {init.name: list(init.dims) for init in graph.initializer}
        tables = sorted(name for name, shape in shapes.items() if sorted(shape) == [64, 512])
        assert len(tables) == 1, tables
        table = tables[0]
        assert table.endswith(".transposed") == stored, (target, table)
        if stored:
            assert shapes[table] == [64, 512]
            assert not [n for n in graph.node if n.op_type == "Transpose" and table in n.input]
            assert len([n for n in graph.node if n.op_type == "MatMul" and table in n.input]) == 1
            lookups = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == table]
            assert len(lookups) == 1 and onnx.helper.get_node_attr_value(lookups[0], "axis") == 1


def test_both_graphs_share_one_weights_file(exported) -> None:
    folder = exported("llama-tiny", "ort")
    locations = {}
    for phase in ("prefill", "decode"):
        graph = onnx.load(folder / f"{phase}.onnx", load_external_data=False).graph
        for init in graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                entry = {item.key: item.value for item in init.external_data}
                locations.setdefault(phase, {})[init.name] = (entry["location"], entry["offset"])
    assert {loc for loc, _ in locations["prefill"].values()} == {"model.weights"}
    assert {loc for loc, _ in locations["decode"].values()} == {"model.weights"}
    # The embedding (largest tensor) is referenced by both graphs at the same offset: one copy.
    shared = set(locations["prefill"].values()) & set(locations["decode"].values())
    assert len(shared) >= len(locations["decode"]) - 2
    manifest = json.loads((folder / "kvforge.json").read_text())
    assert manifest["files"]["model.weights"]["bytes"] <= manifest["weights_sharing"]["unshared_bytes"] / 2 + 4096


def _session(folder, phase):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(folder / f"{phase}.onnx"), options, providers=["CPUExecutionProvider"])


def _empty_cache(manifest, batch, capacity):
    kv = manifest["kv_cache"]
    shape = (batch, kv["num_kv_heads"], capacity, kv["head_dim"])
    return {f"past_{kind}.{i}": np.zeros(shape, np.float32) for i in range(kv["num_layers"]) for kind in ("key", "value")}


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_chunked_prefill_equals_one_prefill(target: str, exported) -> None:
    # Prefill with past_lens > 0 is legal (chunked prefill / multi-turn): two chunks of the prompt
    # must give the same last logits and the same cache as one prefill of the whole prompt.
    folder = exported("mistral-tiny", target)
    manifest = load_manifest(folder)
    prefill = _session(folder, "prefill")
    names = [o.name for o in prefill.get_outputs()]
    prompt = np.array([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]])
    capacity = 32
    whole = prefill.run(None, {"input_ids": prompt, "past_lens": np.array([0], np.int32),
                               "logits_index": np.array([[prompt.shape[1] - 1]]), **_empty_cache(manifest, 1, capacity)})
    first = prefill.run(None, {"input_ids": prompt[:, :12], "past_lens": np.array([0], np.int32),
                               "logits_index": np.array([[11]]), **_empty_cache(manifest, 1, capacity)})
    cache = {name.replace("present", "past"): value for name, value in zip(names[1:], first[1:], strict=True)}
    second = prefill.run(None, {"input_ids": prompt[:, 12:], "past_lens": np.array([12], np.int32),
                                "logits_index": np.array([[prompt.shape[1] - 13]]), **cache})
    np.testing.assert_allclose(second[0], whole[0], atol=1e-4)
    np.testing.assert_allclose(second[1][:, :, : prompt.shape[1]], whole[1][:, :, : prompt.shape[1]], atol=1e-5)


def test_unsupported_architecture_says_where_the_supported_ones_are(tmp_path) -> None:
    from transformers import DiffLlamaConfig, UMT5Config

    from kvforge.models.families import families

    DiffLlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=2, architectures=["DiffLlamaForCausalLM"]).save_pretrained(tmp_path / "diff")
    # Not ~150 class names on one line (issue 43, 22): the count and the page.
    with pytest.raises(UnsupportedModelError, match=r"unsupported model_type 'diffllama' \(DiffLlamaForCausalLM\): "
                       rf"differential attention.*; kvforge supports {len(families())} decoder-only model types, "
                       r"listed in docs/models.md$"):
        export_model(tmp_path / "diff", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    UMT5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=100).save_pretrained(tmp_path / "u")
    with pytest.raises(UnsupportedModelError, match=r"^model_type 'umt5' is an encoder-decoder model kvforge does not "
                       r"export yet: of those it exports bart, mbart, marian, pegasus, m2m_100, blenderbot, "
                       r"blenderbot-small, plbart, whisper, t5, mt5; see docs/encoder-decoder.md$"):
        export_model(tmp_path / "u", tmp_path / "out")


def test_missing_and_non_hf_folders(tmp_path) -> None:
    with pytest.raises(InputError, match="nope does not exist; pass a local Hugging Face model folder or a .gguf file"):
        export_model(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        export_model(tmp_path / "empty", tmp_path / "out")


def test_existing_output_needs_force(tmp_path, hf_folder) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    for force in (False, True):
        with pytest.raises(InputError, match="is not a kvforge export .no kvforge.json.; refusing to replace it"):
            export_model(hf_folder("llama-tiny"), out, force=force)
    assert (out / "keep.txt").read_text() == "user data"


def test_failed_export_leaves_nothing_behind(tmp_path, hf_folder, monkeypatch) -> None:
    import kvforge.exporter.export as export_module

    def broken(*_args, **_kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "save_with_shared_weights", broken)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="export of .* failed: RuntimeError: disk full"):
        export_model(hf_folder("llama-tiny"), out)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a staging sibling


def test_tampered_export_is_refused(tmp_path, exported) -> None:
    from kvforge.core.errors import ManifestError

    folder = tmp_path / "copy"
    shutil.copytree(exported("llama-tiny", "ort"), folder)
    with open(folder / "model.weights", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ManifestError, match="truncated or replaced"):
        load_manifest(folder)
    (folder / "kvforge.json").unlink()
    with pytest.raises(ManifestError, match="holds an export.s graphs but no kvforge.json: the export is damaged"):
        load_manifest(folder)


def test_onnx_target_updates_the_cache_in_place_on_every_step(exported) -> None:
    # ONNX Runtime's TensorScatter warns "in-place optimization not activated" whenever it copies
    # the cache. The runtime binds past and present to one buffer, so no step may warn. Control:
    # a plain session.run (separate output buffers) does warn, so the probe can see a copy.
    import subprocess
    import sys

    folder = exported("llama-tiny", "onnx")
    script = f"""
import numpy as np, onnxruntime as ort
from kvforge.runtime import Generator
import sys
Generator({str(folder)!r}).generate([[1, 5, 6, 7], [1, 9]], max_new_tokens=12, greedy=True, ignore_eos=True)
sys.stderr.write("--- control ---\\n"); sys.stderr.flush()
s = ort.InferenceSession({str(folder / "decode.onnx")!r}, providers=["CPUExecutionProvider"])
feeds = {{"input_ids": np.ones((1, 1), np.int64), "past_lens": np.zeros(1, np.int32)}}
for i in range(2):
    for kind in ("key", "value"):
        feeds[f"past_{{kind}}.{{i}}"] = np.zeros((1, 2, 8, 16), np.float32)
s.run(None, feeds)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    generate_log, control_log = out.stderr.split("--- control ---")
    assert "in-place optimization not activated" not in generate_log
    assert "in-place optimization not activated" in control_log


@pytest.mark.parametrize("constant, kept", [(1e-8, True), (1e-12, True), (0.0, False)])
def test_the_cleanup_drops_only_an_exact_zero_add(constant: float, kept: bool) -> None:
    # onnxscript's add_0 rule matches |c| <= 1e-8: it deleted Helium's RMSNorm eps (1e-8), and an
    # all-zero embedding row (the padding token's) then normalised to NaN.
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from kvforge.exporter.optimize import optimize_graph

    nodes = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.FLOAT, [], [constant])),
             helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Sqrt", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    optimize_graph(model)
    assert ("Add" in [node.op_type for node in model.graph]) == kept


@pytest.mark.parametrize(("domain", "attributes", "folds"), [
    ("ai.onnxruntime._fusion", {}, True),  # onnxscript's intermediate node (transformers 5.24's trace)
    ("com.microsoft", {}, True),  # ONNX Runtime's own, its cos/sin fusion already run (transformers 5.17's trace)
    ("com.microsoft", {"interleaved": 1}, False),
    ("com.microsoft", {"rotary_embedding_dim": 8}, False),  # partial rotary: GQA's do_rotary rotates all of D
    ("com.microsoft", {"scale": 0.5}, False),  # scaled positions are not past_lens + t
])
def test_rope_before_attention_folds_only_as_gqa_computes_it(domain, attributes, folds) -> None:
    import onnx_ir as ir

    from kvforge.exporter.graph_edit import pre_rotary

    y = ir.Value(name="y", shape=ir.Shape(["batch", "seq", 4, 16]), type=ir.TensorType(ir.DataType.FLOAT))
    inputs = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT)) for n in ("positions", "cos", "sin")]
    tape = ir.tape.Tape()
    heads_first = tape.op("Transpose", [y], attributes={"perm": [0, 2, 1, 3]})
    rotated = tape.op("RotaryEmbedding", [heads_first, *inputs], attributes={"interleaved": 0, **attributes},
                      domain=domain)
    back = tape.op("Transpose", [rotated], attributes={"perm": [0, 2, 1, 3]})
    shape = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([0, 0, -1], np.int64))})
    q = tape.op("Reshape", [back, shape])
    found = pre_rotary(q)
    assert (found is not None) is folds
    if folds:
        assert found[0] is y and found[1].op_type == "RotaryEmbedding"


def test_an_export_that_appears_meanwhile_is_not_replaced_without_force(hf_folder, exported, tmp_path, monkeypatch):
    """Two exports to the same new folder without --force: the later one used to replace the first silently
    (issue 43, 7). Now it stops before publishing and leaves the other run's export as it is."""
    import shutil

    from kvforge.core import output_folder
    from kvforge.exporter.export import export_model

    out, other = tmp_path / "out", exported("llama-tiny")

    def the_other_run(name: str) -> None:
        if name == "export:manifest-written" and not out.exists():
            shutil.copytree(other, out)  # the other export finishes first

    monkeypatch.setattr(output_folder, "FAULT_HOOKS", [the_other_run])
    with pytest.raises(InputError, match="appeared while this run wrote its kvforge export .another run made it.; "
                                         "it was left as it is"):
        export_model(hf_folder("qwen2-tiny"), out)
    assert json.loads((out / "kvforge.json").read_text())["model"]["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    export_model(hf_folder("qwen2-tiny"), out, force=True)  # --force replaces it
    assert json.loads((out / "kvforge.json").read_text())["model"]["model_type"] == "qwen2"
