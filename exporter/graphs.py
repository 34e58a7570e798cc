"""The graphs of an export: the model (fake weights streamed from the checkpoint, or loaded whole), probed,
traced once, cleaned up, fused, quantised, the decode graph derived and both lowered for the target.

exporter/export.py checks the request and writes the result; this module makes the two graphs in memory
(their weights lazy reads of the checkpoint where the export streams: exporter/lazy_weights.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.core.contract import KVLayout, StateSpec
from kvforge.core.errors import KvforgeError
from kvforge.exporter.load import load_hf_model, one_line
from kvforge.exporter.probe import layer_shapes, probe_states
from kvforge.exporter.quantization.plan import QuantPlan
from kvforge.exporter.targets import ExportTarget
from kvforge.models.families import Family
from kvforge.models.families.surgery import Patches


@dataclass
class ExportWork:
    """The plan of one export, what every stage reads: the model's config and family, the target (resolved once)
    and options, the activations' torch dtype, the source folder and its checkpoint, and where progress goes."""

    config: Any
    family: Family
    target: ExportTarget
    options: Any  # exporter.export.ExportOptions
    torch_dtype: Any
    model_dir: Path
    checkpoint: Any  # exporter.checkpoint.Checkpoint
    say: Callable[[str], None]
    # What the weights become and why (exporter/quantization/plan.py), resolved once; applied in build_graphs
    plan: QuantPlan
    # Weights already held as integers (a pre-quantised checkpoint, a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks, AutoRound's):
    # carried into MatMulNBits as they are (exporter/quantization/exact_blocks.py); None: every weight is rounded
    int_weights: Any = None
    gguf_record: dict[str, Any] | None = None  # the GGUF the model folder was converted from, if it was
    # A vision-language checkpoint exported whole (models/vision_families.py): its row; None: text only
    vision: Any = None
    # A speculation head exported beside the target as draft.onnx (a checkpoint's MTP layer: exporter/mtp_head.py):
    # `expose(prefill)` gives the target graph the hidden states the head reads, `build(work, layout)` makes the
    # head's graph and manifest record; None: no head
    draft: Any = None


@dataclass
class MadeGraphs:
    """What make_graphs gives the writer: the two lowered graphs, the weight quantisation's and the quantised KV
    cache's records (None when not asked for), and the KV layout the probe found."""

    graphs: dict[str, Any]
    quantization: dict[str, Any] | None
    kv_quant: dict[str, Any] | None
    layout: KVLayout
    vision: dict[str, Any] | None = None  # a vision-language export's manifest record (exporter/vision.py)
    draft: dict[str, Any] | None = None  # a speculation head's manifest record (ExportWork.draft)


class Clock:
    """Where the export's time goes (manifest "export_seconds"): laps by name, summed."""

    def __init__(self, laps: dict[str, float]) -> None:
        self.laps, self.mark = laps, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.mark
        self.mark = now


def make_graphs(work: ExportWork, layout: KVLayout, laps: dict[str, float], lower: Callable[..., Any],
                families: Mapping[str, Family] | None) -> MadeGraphs:
    """The graphs (a vision-language export's vision.onnx too), the quantisation and KV-cache records and the KV
    layout."""
    lap = Clock(laps)
    made = _text_graphs(work, layout, laps, lap, lower, families)
    if work.vision is not None:
        made.vision = add_vision_graph(made.graphs, work)
        lap("vision")
    if work.draft is not None:
        from kvforge.core.contract import DRAFT

        made.graphs[DRAFT], made.draft = work.draft.build(work, made.layout)
        work.plan.apply_to_draft(made.graphs[DRAFT], made.draft)
        lap("draft")
    return made


def _text_graphs(work: ExportWork, layout: KVLayout, laps: dict[str, float], lap: Clock, lower: Callable[..., Any],
                 families: Mapping[str, Family] | None) -> MadeGraphs:
    """Prefill and decode; streamed where the model allows it, else (and where tracing with fake weights fails)
    from the whole model, saying why."""
    from kvforge.exporter.lazy_weights import Gap, empty_model, streaming_refusal

    say = work.say
    why = streaming_refusal(work.config, work.options, work.family, work.plan) if work.options.stream else "--no-stream"
    empty = None
    if why is None:
        from kvforge.exporter.text_model import text_of
        from kvforge.exporter.text_stream import stream_text_model

        # A multimodal checkpoint's text model: its tensors found under their renamed names (text_stream.py).
        make_empty = stream_text_model if text_of(work.config) is not None else empty_model
        empty, why = make_empty(work.config, work.torch_dtype, work.checkpoint, work.family)
    if empty is not None:
        gb = work.checkpoint.nbytes / 1e9
        say(f"streaming {gb:.2f} GB of weights from the checkpoint, tensor by tensor (the model is traced without them)")
        try:
            lap("load")
            # Every change to the model and to transformers' modules is undone when the export is done with them.
            with Patches() as patches:
                with empty.fake_mode:
                    layout = _prepare(empty.model, work, layout, patches)
                return MadeGraphs(*build_graphs(empty.model, work, layout, lap, lower, empty), layout)
        except KvforgeError:
            raise
        except Exception as err:  # noqa: BLE001 - a model whose code needs real weights to trace
            why = f"tracing it with fake weights failed ({type(err).__name__}: {one_line(err)[:200]})"
    say(f"loading the whole model ({', '.join(work.config.architectures or [work.config.model_type])}, "
        f"{work.options.dtype}): {why}")
    laps.pop("load", None)
    lap.mark = time.perf_counter()
    model = load_hf_model(work.model_dir, work.options.dtype, families, why.refusal if isinstance(why, Gap) else None)
    lap("load")
    with Patches() as patches:
        layout = _prepare(model, work, layout, patches)
        return MadeGraphs(*build_graphs(model, work, layout, lap, lower, None), layout)


def add_vision_graph(graphs: dict[str, Any], work: ExportWork) -> dict[str, Any]:
    """vision.onnx beside the text graphs (exporter/vision.py), traced from the whole checkpoint; its record."""
    from kvforge.core.contract import VISION
    from kvforge.exporter.vision import (
        image_shape,
        load_vision_language_model,
        processor_record,
        trace_vision,
        vision_record,
    )

    if work.vision.patches:
        return _add_patch_vision_graph(graphs, work)
    processor = processor_record(work.model_dir, work.vision)
    work.say(f"tracing the image tower and projector of {work.vision.model_type} (vision.onnx)")
    model = load_vision_language_model(work.model_dir, work.options.dtype)
    shape = image_shape(processor, model.config)
    if work.vision.tiling:  # an image's tiles as one batch (exporter/vision_tiles.py)
        from kvforge.exporter.vision_tiles import tiles_fields, trace_tiles

        graphs[VISION], per_tile = trace_tiles(model, work.vision, shape, work.torch_dtype)
        return {**vision_record(model, work.vision, processor, shape, per_tile, work.model_dir),
                **tiles_fields(model, work.vision, work.model_dir, per_tile)}
    graphs[VISION], tokens = trace_vision(model, work.vision, shape, work.torch_dtype)
    return vision_record(model, work.vision, processor, shape, tokens, work.model_dir)


def _dtype_name(torch_dtype: Any) -> str:
    """float32 / float16 / bfloat16: a torch dtype's name, as the contract spells cache dtypes."""
    return str(torch_dtype).removeprefix("torch.")


def _prepare(model: Any, work: ExportWork, layout: KVLayout, patches: Patches) -> KVLayout:
    from kvforge.core.output_folder import fault_point

    layout = adapt_for_export(model, work.family, layout, patches, work.say)
    layout = probe_model(model, work, layout, patches)
    fault_point("export:model-loaded")
    return layout


def adapt_for_export(model: Any, family: Family, layout: KVLayout, patches: Patches,
                     say: Callable[[str], None]) -> KVLayout:
    """Apply the family's patch (its module's: models/families/) on `patches`, and cap the layout's capacity where
    the family's attention is exact only over fewer positions, saying why."""
    if family.patch is not None:
        say(f"adapted {model.config.model_type} for export: {family.patch(model, patches)}")
    limit = family.capacity(model.config) if family.capacity is not None else None
    if limit is not None and limit[0] < layout.max_capacity:
        layout = dataclasses.replace(layout, max_capacity=limit[0])
        say(f"note: {limit[1]}")
    return layout


def probe_model(model: Any, work: ExportWork, layout: KVLayout, patches: Patches) -> KVLayout:
    """Prepare the loaded model's experts for export (on `patches`) and check the attention shapes HF really
    passes against the target; the KV layout those shapes give."""
    config, family, say = work.config, work.family, work.say
    # Mixture-of-experts layers: SwiGLU-gated experts become the canonical MoE node (plugins/moe_op.py;
    # ONNX Runtime's MoE on `ort`, the picked experts gathered on the others); any other gate keeps
    # transformers' "batched_mm" gather form. Its default implementations have no ONNX form.
    from kvforge.exporter.experts_routing import prepare_looped_experts

    looped = prepare_looped_experts(model, family, patches)  # experts written as a loop over the picked ones
    if looped:
        say(f"experts: {looped} looped MoE layers as the canonical MoE node")
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        from kvforge.exporter.experts_routing import prepare_experts, set_experts_implementation

        set_experts_implementation(model, "batched_mm", patches)
        routed = prepare_experts(model, patches)
        say(f"experts: {routed['node']} MoE layers as the canonical MoE node"
            + (f", {routed['batched_mm']} in transformers' batched_mm form" if routed["batched_mm"] else ""))
    # Recurrent / linear-attention layers whose state lives in transformers' cache keep it as state buffers.
    found = probe_states(model, family)
    states = tuple(StateSpec(layer, kind, shape, _dtype_name(torch_dtype))
                   for layer, kinds in sorted(found.items()) for kind, (shape, torch_dtype) in sorted(kinds.items()))
    if states:
        say(f"recurrent state: {len({spec.layer for spec in states})} layers keep {len(states)} state buffers "
            f"({', '.join(sorted({spec.kind for spec in states}))})")
    # The head counts HF's attention really receives (a config's own convention can differ:
    # multi_query, num_kv_heads, ...), per layer: the KV cache follows them.
    shapes = layer_shapes(model, layout.num_layers, frozenset(found))
    probed = KVLayout.per_layer([None if shape is None else (shape.kv_heads, shape.cache_dim) for shape in shapes],
                                layout.dtype, layout.max_capacity, states)
    layout = probed
    sinks = any(shape.sinks for shape in shapes if shape is not None)
    work.target.check_probed(config, family, work.options.dtype, layout, sinks)
    return layout


def build_graphs(model: Any, work: ExportWork, layout: KVLayout, lap: Clock, lower: Callable[..., Any],
                 empty: Any = None) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Trace, clean up, fuse, (quantise,) derive decode and lower: the two graphs in memory, the weight
    quantisation's record and the quantised KV cache's (None when not asked for)."""
    from kvforge.exporter.fusions import rotary_caches
    from kvforge.exporter.optimize import fuse_graph, optimize_graph
    from kvforge.exporter.trace import derive_decode_graph

    target, options, plan, say = work.target, work.options, work.plan, work.say

    prefill = _trace(model, work, layout, empty)
    lap("trace")
    optimize_graph(prefill)
    lap("optimize")
    fused = fuse_graph(prefill, target, quantized=plan.quantize is not None, dtype=options.dtype,
                       merge_pairs=options.merge_pairs)
    lap("fuse")
    say("fused " + ", ".join(f"{count} {name}" for name, count in fused.items() if count))
    prefill, applied = plan.apply(prefill, model, work, layout, lap)  # weights, KV cache scales, experts' bits
    # After quantisation, not in fuse_graph: the quantiser shares a tied embedding with its lm_head itself.
    if target.ort_fusions and plan.quantize is None:
        from kvforge.exporter.fusions import pretranspose_tied_lm_head

        pretranspose_tied_lm_head(prefill)
    if work.draft is not None:  # the head reads hidden states the target graphs then output too
        work.draft.expose(prefill)
    graphs = {"prefill": prefill, "decode": derive_decode_graph(prefill)}
    # An M-RoPE prefill rotates by the positions it is given (three streams), not by past_lens: RoPE stays in the graph.
    rotary = rotary_caches(model, layout.max_capacity, layout.dtype) \
        if target.ort_fusions and not _mrope(work) else None
    for phase, graph in graphs.items():
        say(f"lowering {phase} attention for target {target.name}")
        lower(graph, target, rotary, applied.kv_scales, applied.experts, attends=bool(layout.layer_shapes()))
        graph.ir_version = 10  # onnxruntime refuses IR versions newer than it knows
    lap("derive_and_lower")
    return graphs, applied.record, applied.kv_record


def _add_patch_vision_graph(graphs: dict[str, Any], work: ExportWork) -> dict[str, Any]:
    """vision.onnx of a tower that takes images at their own size (exporter/vision_patches.py) and its record."""
    from kvforge.core.contract import VISION
    from kvforge.exporter.vision import load_vision_language_model, vision_record
    from kvforge.exporter.vision_mrope import (
        image_processor_record,
        patch_vision_fields,
        video_processor_record,
    )
    from kvforge.exporter.vision_patches import patch_vision_io, trace_patch_vision

    processor = image_processor_record(work.model_dir)
    work.say(f"tracing the image tower and merger of {work.vision.model_type} (vision.onnx, images at their own size)")
    model = load_vision_language_model(work.model_dir, work.options.dtype)
    graphs[VISION] = trace_patch_vision(model, work.vision.model_type, work.torch_dtype)
    inputs, _ = patch_vision_io(work.vision.model_type)
    deepstack = work.vision.deepstack(model.config) if work.vision.deepstack is not None else 0
    video = video_processor_record(work.model_dir, processor, work.vision.model_type)
    return {**vision_record(model, work.vision, processor, (0, 0), 0, work.model_dir),
            **patch_vision_fields(model, inputs[1:], deepstack),
            # Its videos: the video processor's record, and where a prompt and a chat template put one.
            **({"video": video, "video_placeholder": "<video>",
                "video_chat_placeholder": "<|vision_start|><|video_pad|><|vision_end|>"} if video else {})}


def _mrope(work: ExportWork) -> bool:
    """Whether the export's prefill takes multimodal positions (a whole Qwen-VL checkpoint; its --text-only export
    has the three streams equal to past_lens + t)."""
    return work.vision is not None and work.family.mrope


def _deepstack(work: ExportWork) -> int:
    """How many text layers add an image token's DeepStack features (its features row's further blocks)."""
    if work.vision is None or work.vision.deepstack is None:
        return 0
    from transformers import AutoConfig

    return work.vision.deepstack(AutoConfig.from_pretrained(work.model_dir, local_files_only=True))


def _image_token(work: ExportWork) -> int | None:
    """The image token id a vision-language export's prefill graph merges image features at (None: text only)."""
    if work.vision is None:
        return None
    from kvforge.exporter.vision import checkpoint_image_token

    return checkpoint_image_token(work.model_dir)


def _trace(model: Any, work: ExportWork, layout: KVLayout, empty: Any) -> Any:
    """The canonical prefill graph. Streamed, a model of alike layers is traced with two and the rest
    stamped (exporter/layer_stamping.py); then every fake weight gets its lazy checkpoint read."""
    from kvforge.exporter.trace import trace_prefill

    aux = getattr(work.draft, "aux_layer_ids", None)  # an EAGLE-3 head reads these layers' inputs (draft_head.py)
    if empty is None:
        work.say("tracing the model once (torch.onnx, dynamo); the decode graph is derived from it")
        return trace_prefill(model, layout, work.torch_dtype, work.family, image_token_id=_image_token(work),
                             aux_layers=aux, mrope=_mrope(work), deepstack=_deepstack(work))
    from kvforge.exporter.layer_stamping import StampRefused, stamp_layers, stamp_plan, traced_prefix
    from kvforge.exporter.lazy_weights import attach_weights

    images = {"image_token_id": _image_token(work), "mrope": _mrope(work), "deepstack": _deepstack(work)}
    plan = "--no-stamp" if not work.options.stamp else "an EAGLE-3 head reads chosen layers' inputs" \
        if aux is not None else "image features are added at chosen layers (DeepStack)" if images["deepstack"] \
        else stamp_plan(model, work.config, layout, work.family)
    prefill = None
    if not isinstance(plan, str):
        work.say(f"tracing 2 of the {plan.total} alike layers (torch.onnx, dynamo) and stamping the rest; "
                 "the decode graph is derived from it")
        with traced_prefix(model, plan, layout) as short:
            prefill = trace_prefill(model, short, work.torch_dtype, work.family, empty.fake_mode, **images)
        try:
            stamp_layers(prefill, plan, layout)
        except StampRefused as why:
            plan, prefill = str(why), None
    if prefill is None:
        work.say(f"tracing the model once (torch.onnx, dynamo; every layer: {plan}); the decode graph is derived "
                 "from it")
        prefill = trace_prefill(model, layout, work.torch_dtype, work.family, empty.fake_mode, aux_layers=aux,
                                **images)
    attach_weights(prefill, empty, work.checkpoint)
    return prefill
