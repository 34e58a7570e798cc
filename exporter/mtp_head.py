"""A checkpoint's multi-token-prediction layer as the speculation head graph `draft.onnx` (kvforge/core/contract.py,
"Speculation's head graph"; the layer's format and conventions: models/mtp.py).

The MTP layer's decoder block runs inside a one-layer model of the family (transformers' own classes, loaded from
the layer's tensors), so its attention goes through kvforge's op like the target's (MLA included) and its cache
follows the KV contract: layer 0 of the head, `past_lens` its own length. The glue (the two norms and the
projection in front of the block, the shared head's norm and head behind it) is applied around the block here.
The target's prefill and decode graphs gain `target_hidden`: the final normed hidden state of every position.

The head is exported in the export's float dtype: `--quantize` and `--kv-cache` apply to the target only
(`--draft-lm-head-bits` makes the head's lm_head a MatMulNBits: exporter/quantization/draft_lm_head.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvforge.core.contract import (
    DRAFT,
    DRAFT_HIDDEN,
    DTYPES,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    PAST_LENS,
    TARGET_HIDDEN,
    TOKEN_MAP,
    KVLayout,
)
from kvforge.core.errors import InputError
from kvforge.models import mtp


class MtpHeadModule(torch.nn.Module):
    """forward(input_ids, target_hidden, draft_hidden, past_lens, *past) -> (logits, hidden_out, *present).

    `lm` is the one-layer model holding the MTP block (its embedding the layer's, its final norm replaced by the
    identity so the block's output is `hidden_out`); `norm` and the glue norms are the family's RMSNorm."""

    def __init__(self, lm: Any, glue: dict[str, Any], fmt: mtp.MtpFormat, layout: KVLayout) -> None:
        super().__init__()
        from kvforge.models.families.surgery import backbone

        self.lm, self.layout, self.embedding_first = lm, layout, fmt.embedding_first
        self.hidden_out_normed = fmt.hidden_out_normed
        base = backbone(lm)
        self.norm, base.norm = base.norm, torch.nn.Identity()  # the shared head's norm, applied after hidden_out
        norm_class = type(self.norm)
        eps = lm.config.rms_norm_eps
        hidden = lm.config.hidden_size
        self.enorm, self.hnorm = norm_class(hidden, eps=eps), norm_class(hidden, eps=eps)
        dtype = next(lm.parameters()).dtype
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        with torch.no_grad():
            self.enorm.weight.copy_(glue["enorm"])
            self.hnorm.weight.copy_(glue["hnorm"])
            self.proj.weight.copy_(glue["proj"])
        self.enorm.to(dtype)
        self.hnorm.to(dtype)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, draft_hidden: torch.Tensor,
                past_lens: torch.Tensor, *past: torch.Tensor):
        from kvforge.exporter.wrapper import _TRACING, ATTN_IMPLEMENTATION, _CacheState
        from kvforge.models.families.surgery import backbone

        named = dict(zip(self.layout.buffers(), past, strict=True))
        state = _CacheState([(named[(0, "key")], named[(0, "value")])], past_lens)
        embedded = self.enorm(self.lm.get_input_embeddings()(input_ids))
        given = self.hnorm(target_hidden + draft_hidden)  # the runtime zeroes the one it does not use
        parts = [embedded, given] if self.embedding_first else [given, embedded]
        block_in = self.proj(torch.cat(parts, dim=-1))
        position_ids = past_lens.to(torch.int64)[:, None] + torch.arange(input_ids.shape[1], dtype=torch.int64)
        config = self.lm.config
        saved, config._attn_implementation = config._attn_implementation, ATTN_IMPLEMENTATION
        _TRACING["state"] = state
        try:
            hidden_out = backbone(self.lm)(inputs_embeds=block_in, position_ids=position_ids,
                                           use_cache=False).last_hidden_state
        finally:
            config._attn_implementation = saved
            _TRACING.pop("state", None)
        normed = self.norm(hidden_out)
        logits = self.lm.get_output_embeddings()(normed).float()
        hidden_out = normed if self.hidden_out_normed else hidden_out  # what the family chains (models/mtp.py)
        present = [state.present[0][0 if kind == "key" else 1] for _, kind in self.layout.buffers()]
        return (logits, hidden_out, *present)


def _load_block_model(config: Any, weights: mtp.MtpWeights, torch_dtype: Any) -> Any:
    """The one-layer model of the family holding the MTP block, loaded by transformers' own loader (which turns
    per-expert tensors into its fused form) from a scratch folder of the layer's tensors; InputError naming any
    block tensor the family's layer lacks, or has that it does not."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    head_config = mtp.one_layer_config(config)
    tensors = {**weights.block, "model.embed_tokens.weight": weights.glue["embed"],
               "model.norm.weight": weights.glue["norm"], "lm_head.weight": weights.glue["head"]}
    with tempfile.TemporaryDirectory(prefix="kvforge-mtp-") as scratch:
        head_config.save_pretrained(scratch)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(Path(scratch) / "model.safetensors"),
                  metadata={"format": "pt"})
        try:
            # Mismatched sizes are reported (mismatched_keys, refused below), not raised without their names.
            lm, info = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch_dtype, output_loading_info=True,
                                                            ignore_mismatched_sizes=True)
        except Exception as err:  # noqa: BLE001 - transformers' loader says misshaped tensors its own way
            raise InputError(f"the checkpoint's MTP block ({weights.block_prefix}*) does not load as a "
                             f"{config.model_type} layer: {str(err).splitlines()[0][:200]}; export with --no-mtp "
                             "to leave it out") from None
    wrong = [f"missing {name}" for name in info.get("missing_keys", ())] + \
        [f"unexpected {name}" for name in info.get("unexpected_keys", ())] + \
        [f"{item[0]} of shape {list(item[1])} where the layer has {list(item[2])}" if isinstance(item, tuple)
         else f"misshaped {item}" for item in info.get("mismatched_keys", ())]
    if wrong:
        shown = ", ".join(w.replace("model.layers.0.", weights.block_prefix) for w in sorted(wrong)[:3])
        raise InputError(f"the checkpoint's MTP block ({weights.block_prefix}*) is not a {config.model_type} layer: "
                         f"{shown}{', ...' if len(wrong) > 3 else ''}; export with --no-mtp to leave it out")
    return lm.eval()


@dataclasses.dataclass
class MtpDraft:
    """The draft-head step of an export (exporter/graphs.py calls `expose` on the target's prefill graph and
    `build` for draft.onnx): a checkpoint's first MTP layer, read and checked when the export starts."""

    config: Any
    weights: mtp.MtpWeights
    layers: int  # MTP layers the checkpoint declares (the first is exported)

    def expose(self, prefill: Any) -> None:
        """Give the target's prefill graph (before decode is derived from it) the output TARGET_HIDDEN: the final
        normed hidden state of every position, which the head reads."""
        expose_final_hidden(prefill)

    def build(self, work: Any, target_layout: KVLayout) -> tuple[Any, dict[str, Any]]:
        """draft.onnx in memory (lowered for the export's target) and its manifest record."""
        return build_mtp_graph(self, work, target_layout)


def mtp_draft(config: Any, checkpoint: Any, wanted: bool, say: Callable[[str], None],
              target: Any = None) -> MtpDraft | None:
    """The export's MTP draft head: None with --no-mtp, for a family without an MTP format, a checkpoint that
    declares MTP layers (num_nextn_predict_layers) but ships none of their tensors, or a target without draft heads
    (both said); InputError for a layer shipped incomplete or misshaped."""
    layers = mtp.mtp_layer_count(config)
    if not wanted or not layers or mtp.mtp_format(config) is None:
        return None
    if target is not None and not getattr(target, "drafts", True) and mtp.shipped(config, checkpoint.names):
        say(f"note: the checkpoint's MTP layer is not exported: --target {target.name} has no draft.onnx path yet")
        return None
    if not mtp.shipped(config, checkpoint.names):
        say(f"note: the config declares {layers} MTP layer(s) (num_nextn_predict_layers) but the checkpoint ships "
            "none of their tensors: no draft head")
        return None
    weights = mtp.read_mtp_layer(config, checkpoint, 0)
    say(f"draft head: the checkpoint's MTP layer 0 ({weights.block_prefix}*, {len(weights.block)} block tensors) "
        "as draft.onnx")
    return MtpDraft(config, weights, layers)


NEEDS_A_HEAD = "--draft-lm-head-bits needs a head: --eagle HEAD_DIR or a checkpoint's MTP layer"


def speculation_head(options: Any, config: Any, checkpoint: Any, family: Any, target: Any, vision: Any,
                     say: Callable[[str], None]) -> Any:
    """The export's speculation head: --eagle's EAGLE-3 head (exporter/draft_head.py), else the checkpoint's MTP
    layer, else None (a target without draft heads: none); checked before anything is written, and
    --draft-lm-head-bits (exporter/quantization/draft_lm_head.py) refused without one."""
    from kvforge.exporter.draft_head import eagle_draft

    draft = mtp_draft(config, checkpoint, options.mtp, say, target) if options.eagle is None \
        else eagle_draft(options.eagle, config, family, target, vision, say)
    if options.draft_lm_head_bits is not None and draft is None:
        raise InputError(NEEDS_A_HEAD)
    return draft


def expose_final_hidden(prefill: Any) -> None:
    """The hidden states the prefill graph's lm_head gathers at `logits_index` (every position of S, after the
    final norm) become the graph output TARGET_HIDDEN; decode, derived from it, keeps the output ([B, 1, H])."""
    from kvforge.exporter.trace import _positions_gather

    graph = prefill.graph
    index = next(value for value in graph.inputs if value.name == LOGITS_INDEX)
    hidden = _positions_gather(index).inputs[0]
    hidden.name = TARGET_HIDDEN
    graph.outputs.append(hidden)


def build_mtp_graph(draft: MtpDraft, work: Any, target_layout: KVLayout) -> tuple[Any, dict[str, Any]]:
    """Load the block model, adapt and probe it as the target's model is (exporter/graphs.py), trace the head,
    clean up, fuse and lower it for the target: (draft.onnx's model, its record)."""
    from kvforge.exporter.draft_head import lower_every_position
    from kvforge.exporter.fusions import rotary_caches
    from kvforge.exporter.graphs import adapt_for_export, probe_model
    from kvforge.exporter.optimize import fuse_graph, optimize_graph
    from kvforge.models.families.surgery import Patches

    config, say, options = work.config, work.say, work.options
    lm = _load_block_model(config, draft.weights, work.torch_dtype)
    head_work = dataclasses.replace(work, config=lm.config)
    layout = KVLayout(num_layers=1, num_kv_heads=work.family.kv_heads(lm.config),
                      # the export's float dtype: a quantised target cache (--kv-cache) does not apply to the head
                      head_dim=work.family.head_dim(lm.config), dtype=DTYPES[options.dtype],
                      max_capacity=target_layout.max_capacity)
    with Patches() as patches:
        layout = adapt_for_export(lm, work.family, layout, patches, say)
        layout = probe_model(lm, head_work, layout, patches)
        fmt = mtp.mtp_format(config)
        head = MtpHeadModule(lm, draft.weights.glue, fmt, layout).eval()
        say("tracing the MTP head (draft.onnx)")
        graph = trace_head(head, layout, work.torch_dtype)
        rotary = rotary_caches(lm, layout.max_capacity, layout.dtype) if work.target.ort_fusions else None
    optimize_graph(graph)
    fuse_graph(graph, work.target, quantized=False, dtype=options.dtype, merge_pairs=options.merge_pairs)
    _add_token_map(graph, int(config.vocab_size))
    lower_every_position(graph, work.target, rotary)  # shared with EAGLE-3's head (exporter/draft_head.py)
    graph.ir_version = 10
    record = {"kind": "mtp", "file": f"{DRAFT}.onnx", "hidden_size": int(config.hidden_size),
              "target_hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size),
              "kv_cache": layout.to_manifest(), "mtp_layers": draft.layers, "exported_layer": 0,
              "weights": {**draft.weights.sources, "block": draft.weights.block_prefix},
              "dtype": options.dtype, "convention": mtp.convention(config)}
    return graph, record


def draft_io(layout: KVLayout) -> tuple[list[str], list[str]]:
    """draft.onnx's input and output names, in graph order (token_map is added after the trace)."""
    inputs = [INPUT_IDS, TARGET_HIDDEN, DRAFT_HIDDEN, PAST_LENS, *layout.cache_inputs()]
    return inputs, [LOGITS, HIDDEN_OUT, *layout.cache_outputs()]


def trace_head(head: MtpHeadModule, layout: KVLayout, torch_dtype: Any) -> Any:
    """The head's graph (onnx_ir): one dynamo trace, batch, sequence and capacity dynamic."""
    import contextlib
    import io
    import warnings

    from torch.export import Dim

    from kvforge.core.progress import quiet_logger
    from kvforge.exporter.trace import OPSET
    from kvforge.plugins.moe_op import CUSTOM_TRANSLATION_TABLE as MOE_TRANSLATION
    from kvforge.plugins.torch_op import CUSTOM_TRANSLATION_TABLE

    batch, seq, capacity = Dim("batch"), Dim("seq"), Dim("capacity")
    b, s, c = 2, 8, 32
    hidden = head.lm.config.hidden_size
    cache = [torch.zeros(layout.buffer_shape(b, c, layer, kind), dtype=torch_dtype) for layer, kind in layout.buffers()]
    args = (torch.ones(b, s, dtype=torch.int64), torch.zeros(b, s, hidden, dtype=torch_dtype),
            torch.zeros(b, s, hidden, dtype=torch_dtype), torch.zeros(b, dtype=torch.int32), *cache)
    inputs, outputs = draft_io(layout)
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch},
              tuple({0: batch, 2: capacity} for _ in cache))  # *past: one entry for the varargs
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(head, args, dynamo=True, input_names=inputs, output_names=outputs,
                                    dynamic_shapes=shapes, opset_version=OPSET, optimize=False, verbose=False,
                                    custom_translation_table={**CUSTOM_TRANSLATION_TABLE, **MOE_TRANSLATION})
    return program.model


def _add_token_map(model: Any, vocab: int) -> None:
    """TOKEN_MAP [V] int64 = arange(V): the head predicts over the target's vocabulary."""
    import numpy as np
    import onnx_ir as ir

    tape = ir.tape.Tape()
    value = tape.op("Constant", [], attributes={"value": ir.tensor(np.arange(vocab, dtype=np.int64), name=TOKEN_MAP)},
                    output=ir.Value(name=TOKEN_MAP))
    value.dtype, value.shape = ir.DataType.INT64, ir.Shape([vocab])
    model.graph.extend(tape.nodes)
    model.graph.outputs.insert(2, value)
