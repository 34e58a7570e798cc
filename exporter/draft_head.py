"""`kvforge export --eagle HEAD_DIR`: an EAGLE-3 head (models/eagle3.py) exported as `draft.onnx` beside the target's
graphs, and the target's graphs made to output the hidden states the head reads (contract.TARGET_HIDDEN).

The head's one decoder layer attends through kvforge's canonical attention op, lowered by the same passes as the
target's (exporter/lowering.py), so its KV cache follows the target's contract: `past_key.0` / `past_value.0`
bound in place, `past_lens` [B] int32, token t of a row at position past_lens + t (RoPE there too). Its graph IO is
contract.GraphIO.draft; the manifest's "draft" record (draft_record) says what the runtime needs to run it.
"""

from __future__ import annotations

import contextlib
import io as io_module
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvforge.core.contract import ATTENTION_OPTIONAL_INPUTS, DRAFT, DTYPES, AttentionAttrs, GraphIO, KVLayout
from kvforge.core.errors import InputError
from kvforge.models.eagle3 import Eagle3Head
from kvforge.plugins import torch_op  # noqa: F401  (registers torch.ops.kvforge.kv_cache_attention)

# The target's token embedding, by the names checkpoints give it (the head reads it where it has none of its own).
EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def check_target(model_config: Any, family: Any, target: Any, vision: Any) -> None:
    """What --eagle refuses of the export itself, before anything loads (a target without draft graphs, trt, is
    refused with the options: exporter/targets/base.py check_options)."""
    if vision is not None:
        raise InputError("--eagle goes with a text model: export the vision-language checkpoint with --text-only")
    if getattr(family, "states", None) is not None or getattr(model_config, "model_type", "") in ("mamba", "mamba2"):
        raise InputError(f"--eagle: {model_config.model_type} keeps recurrent state, which a speculation head's "
                         "rollback does not cover; export it without --eagle")


def target_embedding(checkpoint: Any, vocab: int, hidden: int) -> torch.Tensor:
    """The target's token embedding [V, H] from its checkpoint (fp32)."""
    names = [n for n in checkpoint.names if n.endswith(EMBEDDING_NAMES)
             and tuple(checkpoint.info(n).shape) == (vocab, hidden)]
    if len(names) != 1:
        raise InputError(f"--eagle: the head has no embed_tokens of its own and the target's token embedding "
                         f"[{vocab}, {hidden}] is not one tensor of its checkpoint (found {names}); pass a head with "
                         "embed_tokens.weight")
    return checkpoint.read(names[0]).to(torch.float32)


class DraftModule(torch.nn.Module):
    """forward(input_ids, target_hidden, draft_hidden, past_lens, past_key, past_value) -> (logits, hidden_out,
    token_map, present_key, present_value): the head's layer with transformers' Llama norm, MLP and RoPE modules
    (the graph patterns kvforge's fusions know) and kvforge's attention op."""

    def __init__(self, head: Eagle3Head, embedding: torch.Tensor, torch_dtype: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.head, self.config = head, head.llama_config()
        hidden, eps = head.hidden_size, self.config.rms_norm_eps
        bias = "layer.self_attn.q_proj.bias" in head.weights
        self.embed = torch.nn.Embedding(*embedding.shape)
        self.fc = torch.nn.Linear(head.target_hidden_size, hidden, bias=False)
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(hidden, eps), LlamaRMSNorm(hidden, eps)
        self.post_attention_layernorm, self.norm = LlamaRMSNorm(hidden, eps), LlamaRMSNorm(hidden, eps)
        width = {"q": head.num_heads * head.head_dim, "k": head.num_kv_heads * head.head_dim}
        self.q_proj = torch.nn.Linear(2 * hidden, width["q"], bias=bias)
        self.k_proj = torch.nn.Linear(2 * hidden, width["k"], bias=bias)
        self.v_proj = torch.nn.Linear(2 * hidden, width["k"], bias=bias)
        self.o_proj = torch.nn.Linear(width["q"], hidden, bias="layer.self_attn.o_proj.bias" in head.weights)
        self.mlp = LlamaMLP(self.config)
        self.lm_head = torch.nn.Linear(hidden, head.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        state = {"embed.weight": head.weights.get("embed_tokens.weight", embedding)}
        for name, tensor in head.weights.items():
            if name.startswith("layer."):
                short = name.removeprefix("layer.").removeprefix("self_attn.")
                state[short] = tensor
            elif name in ("fc.weight", "norm.weight", "lm_head.weight"):
                state[name] = tensor
        missing, unexpected = self.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"}, missing
        self.to(torch_dtype).eval()
        self.register_buffer("token_map", head.token_map(), persistent=False)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, draft_hidden: torch.Tensor,
                past_lens: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        head = self.head
        batch, seq = input_ids.shape
        hidden = self.fc(target_hidden) + draft_hidden  # fc is bias-free: a zero input selects the other
        normed = self.hidden_norm(hidden)
        residual = normed if head.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(self.embed(input_ids)), normed], -1)
        split = (batch, seq, -1, head.head_dim)
        q = self.q_proj(x).view(split).transpose(1, 2)
        k = self.k_proj(x).view(split).transpose(1, 2)
        positions = past_lens.to(torch.int64)[:, None] + torch.arange(seq, dtype=torch.int64)
        cos, sin = self.rotary_emb(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attrs = AttentionAttrs(head.num_heads, head.num_kv_heads, float(head.head_dim ** -0.5))
        out, present_key, present_value = torch.ops.kvforge.kv_cache_attention(
            q.transpose(1, 2).reshape(batch, seq, -1), k.transpose(1, 2).reshape(batch, seq, -1), self.v_proj(x),
            past_key, past_value, past_lens, *[None] * len(ATTENTION_OPTIONAL_INPUTS), *attrs.as_dict().values())
        hidden = residual + self.o_proj(out)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        logits = self.lm_head(self.norm(hidden)).float()
        return logits, hidden, self.token_map, present_key, present_value


def draft_layout(head: Eagle3Head, dtype: str, max_capacity: int) -> KVLayout:
    """The head's own KV cache: one layer of its heads, the export's dtype, the target's capacity."""
    return KVLayout(1, head.num_kv_heads, head.head_dim, DTYPES[dtype], max_capacity)


def trace_draft(module: DraftModule, layout: KVLayout, torch_dtype: Any) -> Any:
    """draft.onnx's canonical graph (an onnx_ir model): batch, positions and capacity dynamic."""
    from torch.export import Dim

    from kvforge.core.progress import quiet_logger
    from kvforge.exporter.trace import OPSET
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    batch, seq, capacity = Dim("batch"), Dim("seq"), Dim("capacity")
    b, s, c, head = 2, 8, 32, module.head
    args = (torch.ones(b, s, dtype=torch.int64), torch.zeros(b, s, head.target_hidden_size, dtype=torch_dtype),
            torch.zeros(b, s, head.hidden_size, dtype=torch_dtype), torch.zeros(b, dtype=torch.int32),
            torch.zeros(layout.shape(b, c), dtype=torch_dtype), torch.zeros(layout.shape(b, c), dtype=torch_dtype))
    io = GraphIO.draft(layout)
    rows = {0: batch, 1: seq}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=list(io.inputs), output_names=list(io.outputs),
            dynamic_shapes=(rows, rows, rows, {0: batch}, {0: batch, 2: capacity}, {0: batch, 2: capacity}),
            custom_translation_table=CUSTOM_TRANSLATION_TABLE, opset_version=OPSET, optimize=False, verbose=False)
    return program.model


def lower_every_position(graph: Any, target: Any, rotary: Any) -> None:
    """Lower the head as the target's prefill graph is lowered: ONNX Runtime's lowering tells a one-token decode
    graph by its missing `logits_index` (exporter/targets/ort.py), and the head takes any number of positions a
    call, so a placeholder input of that name, unused, is there while it lowers (as exporter/mtp_head.py does)."""
    import onnx_ir as ir

    from kvforge.core.contract import LOGITS_INDEX
    from kvforge.exporter.lowering import lower

    placeholder = ir.Value(name=LOGITS_INDEX, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", 1]))
    graph.graph.inputs.append(placeholder)
    try:
        lower(graph, target, rotary, None, None, attends=True)
    finally:
        graph.graph.inputs.remove(placeholder)


def token_map_output(graph: Any, token_map: Any) -> None:
    """The TOKEN_MAP output as a Constant node's (the traced graph returns the buffer itself, an initializer)."""
    import onnx_ir as ir

    from kvforge.core.contract import TOKEN_MAP

    at = next(i for i, value in enumerate(graph.graph.outputs) if value.name == TOKEN_MAP)
    graph.graph.outputs[at].name = f"{TOKEN_MAP}_traced"
    tape = ir.tape.Tape()
    value = tape.op("Constant", [], attributes={"value": ir.tensor(token_map.numpy(), name=f"{TOKEN_MAP}_values")},
                    output=ir.Value(name=TOKEN_MAP))
    value.dtype, value.shape = ir.DataType.INT64, ir.Shape([int(token_map.shape[0])])
    graph.graph.extend(tape.nodes)
    graph.graph.outputs[at] = value


def build_draft_graph(head: Eagle3Head, embedding: torch.Tensor, target: Any, dtype: str,
                      max_capacity: int) -> tuple[Any, KVLayout]:
    """draft.onnx lowered for `target` (the same clean-up, fusions and lowering as the target's graphs)."""
    import onnx_ir as ir

    from kvforge.exporter.fusions import rotary_caches
    from kvforge.exporter.optimize import fuse_graph, optimize_graph

    torch_dtype = getattr(torch, DTYPES[dtype])
    layout = draft_layout(head, dtype, max_capacity)
    module = DraftModule(head, embedding, torch_dtype)
    graph = trace_draft(module, layout, torch_dtype)
    token_map_output(graph, module.token_map)
    optimize_graph(graph)
    fuse_graph(graph, target, dtype=dtype)
    # rotary_caches reads a model's `model.rotary_emb` and `config`: the head's, so ORT folds its RoPE as the target's.
    rotary = rotary_caches(SimpleNamespace(model=SimpleNamespace(rotary_emb=module.rotary_emb), config=module.config),
                           max_capacity, layout.dtype) if target.ort_fusions else None
    lower_every_position(graph, target, rotary)
    ir.passes.common.RemoveUnusedNodesPass()(graph)
    graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    return graph, layout


def draft_record(head: Eagle3Head, layout: KVLayout) -> dict[str, Any]:
    """The manifest's "draft" record (kvforge/core/draft_manifest.py checks it at load)."""
    return {"kind": "eagle3", "file": f"{DRAFT}.onnx", "format": head.form, "source": str(head.folder),
            "kv_cache": layout.to_manifest(), "num_heads": head.num_heads, "hidden_size": head.hidden_size,
            "target_hidden_size": head.target_hidden_size, "aux_layer_ids": list(head.aux_layer_ids),
            "draft_vocab_size": head.draft_vocab_size, "norm_before_residual": head.norm_before_residual}


@dataclass
class EagleDraft:
    """The draft-head step of an export with `--eagle` (exporter/graphs.py: `expose` on the traced prefill graph,
    `build` for draft.onnx), read and checked when the export starts. The target graphs' TARGET_HIDDEN is made
    at trace time (exporter/wrapper.py captures the inputs of `aux_layer_ids`), so `expose` only checks it."""

    head: Eagle3Head

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.head.aux_layer_ids

    def expose(self, prefill: Any) -> None:
        from kvforge.core.contract import TARGET_HIDDEN

        if not any(value.name == TARGET_HIDDEN for value in prefill.graph.outputs):
            raise RuntimeError("the traced prefill graph lacks the aux hidden states: exporter/graphs.py _trace "
                               "did not pass aux_layer_ids")

    def build(self, work: Any, target_layout: KVLayout) -> tuple[Any, dict[str, Any]]:
        """draft.onnx in memory (lowered for the export's target) and its manifest record."""
        head, config = self.head, work.config
        embedding = head.weights["embed_tokens.weight"] if "embed_tokens.weight" in head.weights else \
            target_embedding(work.checkpoint, int(config.vocab_size), int(config.hidden_size))
        work.say(f"exporting the EAGLE-3 head of {head.folder} ({head.form} form, reading the inputs of target layers "
                 f"{list(head.aux_layer_ids)}) as {DRAFT}.onnx")
        graph, layout = build_draft_graph(head, embedding, work.target, work.options.dtype, target_layout.max_capacity)
        return graph, draft_record(head, layout)


def eagle_draft(folder: Any, config: Any, family: Any, target: Any, vision: Any,
                say: Callable[[str], None]) -> EagleDraft:
    """The export's EAGLE-3 head (`--eagle`), refused in one line where it does not fit the export or the target."""
    from kvforge.models.eagle3 import read_eagle3_head

    check_target(config, family, target, vision)
    head = read_eagle3_head(folder, config)
    say(f"draft head: EAGLE-3 ({head.form} form), {head.num_heads}/{head.num_kv_heads} heads of {head.head_dim}, "
        f"draft vocabulary {head.draft_vocab_size}, target layers {list(head.aux_layer_ids)}")
    return EagleDraft(head)
