"""A hand-built speculation head for tests/runtime/test_head_runtime.py: the tiny Llama export with `target_hidden` added to
its graphs (its final normed hidden state, as an MTP head reads it) and draft.onnx, one attention layer through the
kvforge op with a learned position table (so that outputs depend on where a position sits) and token_map a sorted
subset of the vocabulary, lowered for the export's target as the exporter lowers its graphs. `fresh` and
`Reference` recompute from scratch: the ONNX graph run without a cache over a whole sequence (causal attention:
position p depends on inputs 0..p only)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from kvforge.core.contract import ATTENTION_OPTIONAL_INPUTS, TARGET_HIDDEN
from kvforge.core.manifest import file_record, io_spec, write_manifest
from kvforge.runtime.drivers.rows import Row

V, DT, H, VD, KV_HEADS, HEAD_DIM = 512, 64, 32, 384, 1, 16


class TinyHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.fc = torch.nn.Embedding(V, H), torch.nn.Linear(DT, H, bias=False)
        self.pos = torch.nn.Embedding(256, H)
        self.q, self.k, self.v = (torch.nn.Linear(H, n * HEAD_DIM) for n in (2, KV_HEADS, KV_HEADS))
        self.o, self.lm = torch.nn.Linear(2 * HEAD_DIM, H), torch.nn.Linear(H, VD)
        subset = np.sort(np.random.default_rng(0).choice(V, VD, replace=False)).astype(np.int64)
        self.register_buffer("tmap", torch.from_numpy(subset))

    def forward(self, input_ids, target_hidden, draft_hidden, past_lens, past_key, past_value):
        pos = past_lens.to(torch.int64)[:, None] + torch.arange(input_ids.shape[1])
        x = self.embed(input_ids) + self.fc(target_hidden) + draft_hidden + self.pos(pos)
        out, key, value = torch.ops.kvforge.kv_cache_attention(
            self.q(x), self.k(x), self.v(x), past_key, past_value, past_lens,
            *[None] * len(ATTENTION_OPTIONAL_INPUTS), 2, KV_HEADS, HEAD_DIM ** -0.5, 0.0, 0)
        h = x + self.o(out)
        h = h + torch.tanh(h)
        return self.lm(h), h, self.tmap + 0, key, value


def build_head(path: Path, target: str) -> None:
    import onnx_ir as ir
    from torch.export import Dim

    from kvforge.exporter.lowering import lower
    from kvforge.exporter.targets import export_target
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    b, s, c = Dim("batch"), Dim("seq"), Dim("capacity")
    args = (torch.ones(2, 5, dtype=torch.int64), torch.zeros(2, 5, DT), torch.zeros(2, 5, H),
            torch.zeros(2, dtype=torch.int32), torch.zeros(2, KV_HEADS, 16, HEAD_DIM), torch.zeros(2, KV_HEADS, 16, HEAD_DIM))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            TinyHead(), args, dynamo=True, opset_version=24, optimize=False, verbose=False,
            input_names=["input_ids", "target_hidden", "draft_hidden", "past_lens", "past_key.0", "past_value.0"],
            output_names=["logits", "hidden_out", "token_map", "present_key.0", "present_value.0"],
            dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}, {0: b}, {0: b, 2: c}, {0: b, 2: c}),
            custom_translation_table=CUSTOM_TRANSLATION_TABLE)
    model = program.model
    ids = next(value for value in model.graph.inputs if value.name == "input_ids")
    ids.name = "head_ids"  # the ort lowering takes a graph with input_ids and no logits_index for decode.onnx
    lower(model, export_target(target))
    ids.name = "input_ids"
    ir.save(model, path)


def add_hidden_output(path: Path) -> None:
    """target_hidden = the final normed hidden state (the lm_head's input, before the prefill's position gather)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    nodes = list(model.graph.node)
    head = next(n for n in nodes if n.op_type == "MatMul" and "lm_head" in n.input[1])
    source = head.input[0]
    gather = next((n for n in nodes if n.output[0] == source and n.op_type == "GatherElements"), None)
    source = gather.input[0] if gather is not None else source
    model.graph.node.append(onnx.helper.make_node("Identity", [source], [TARGET_HIDDEN]))
    model.graph.output.append(onnx.helper.make_tensor_value_info(TARGET_HIDDEN, onnx.TensorProto.FLOAT,
                                                                 ["batch", "seq", DT]))
    onnx.save(model, path)


def make_head_export(source: Path, folder: Path, target: str) -> tuple[Path, dict]:
    """A copy of the export at `source` in `folder`, with target_hidden and the hand-built head (manifest record
    "draft" as kvforge/core/draft_manifest.py describes it)."""
    shutil.copytree(source, folder)
    manifest = json.loads((folder / "kvforge.json").read_text())
    for phase in ("prefill", "decode"):
        graph = manifest["graphs"][phase]
        add_hidden_output(folder / graph["file"])
        graph["outputs"].append(io_spec(TARGET_HIDDEN, "float32", ["batch", "seq", DT]))
        manifest["files"][graph["file"]] = file_record(folder / graph["file"])
    build_head(folder / "draft.onnx", target)
    manifest["draft"] = {"kind": "mtp", "hidden_size": H, "target_hidden_size": DT,
                         "kv_cache": {"num_layers": 1, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                      "dtype": "float32", "max_capacity": manifest["kv_cache"]["max_capacity"]}}
    manifest["graphs"]["draft"] = {"file": "draft.onnx"}
    manifest["files"]["draft.onnx"] = file_record(folder / "draft.onnx")
    write_manifest(folder, manifest)
    return folder, manifest


def session(folder: Path, name: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(str(folder / name), options, providers=["CPUExecutionProvider"])


def fresh(session: ort.InferenceSession, ids, target, draft) -> tuple[np.ndarray, np.ndarray]:
    """The head over one whole sequence from scratch: (logits [S, Vd], hidden_out [S, H])."""
    seq = len(ids)
    shape = next(value.shape for value in session.get_inputs() if value.name == "past_key.0")
    cache = np.zeros((1, shape[1], seq, shape[3]), np.float32)
    logits, hidden = session.run(["logits", "hidden_out"], {
        "input_ids": np.asarray(ids, np.int64)[None], "target_hidden": np.asarray(target, np.float32)[None],
        "draft_hidden": np.asarray(draft, np.float32)[None], "past_lens": np.zeros(1, np.int32),
        "past_key.0": cache, "past_value.0": cache.copy()})
    return logits[0], hidden[0]


class Reference:
    """A row's drafts recomputed from scratch: its context's pairs (token p + 1, hidden p), then the drafted tokens
    chained with zero target states and the previous hidden_out."""

    def __init__(self, graph: ort.InferenceSession, token_map: np.ndarray, widths: tuple[int, int] = (DT, H)) -> None:
        self.graph, self.token_map, (self.target_width, self.width) = graph, token_map, widths

    def drafts(self, row: Row, hidden: np.ndarray, forced: np.ndarray | None = None, k: int = 0):
        ctx = [*row.prompt, *row.tokens]
        ids, target = list(ctx[1:len(hidden) + 1]), list(hidden)
        draft = [np.zeros(self.width, np.float32)] * len(hidden)
        tokens, logits_seen = [], []
        for j in range(len(forced) if forced is not None else k):
            logits, out = fresh(self.graph, ids, np.array(target), np.array(draft))
            logits_seen.append(logits[-1])
            token = int(forced[j]) if forced is not None else int(self.token_map[logits[-1].argmax()])
            tokens.append(token)
            ids, target, draft = ids + [token], target + [np.zeros(self.target_width, np.float32)], draft + [out[-1]]
        return np.array(tokens), logits_seen
