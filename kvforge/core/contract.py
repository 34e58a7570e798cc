"""The contracts every layer shares, defined once (DESIGN.md, "The KV cache contract").

- The graph IO of each graph (`GraphIO`) and the KV layout (`KVLayout`), with their manifest form.
- The fused attention op: its inputs, outputs and attributes (`AttentionAttrs`), the canonical ONNX
  node's identity (`CANONICAL_OP`) and the TensorRT plugin's (`PLUGIN`).
- The export dtypes and their element sizes.

The exporter names graph values from here, every backend binds them from here and the manifest
stores them in the form written here. Plain Python: no torch, onnx or onnxruntime import, so the
runtime and the engine plan can read it. Nothing else in kvforge spells an IO name or the plugin
identity (tests/core/test_contract.py greps for them).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple, get_type_hints

from kvforge.core.errors import ManifestError

# The manifest's `model` section, re-exported: contract stays the one place layers import the contracts from.
from kvforge.core.model_spec import MAX_CONTEXT, MAX_VOCAB_SIZE, ModelSpec, check_token_ids, is_int  # noqa: F401

# -- dtypes --------------------------------------------------------------------------------------
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # export dtype -> tensor dtype
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}  # bytes per element of the KV cache dtypes
# `kvforge export --kv-cache`: quantised KV cache dtypes (export dtype -> cache tensor dtype). The
# scales are constants inside the graphs, so the graph IO keeps its names; only the cache dtype changes.
KV_CACHE_DTYPES = {"int8": "int8"}

# -- graph IO ------------------------------------------------------------------------------------
PHASES = ("prefill", "decode")
INPUT_IDS = "input_ids"  # [B, S] int64 (decode: S = 1)
PAST_LENS = "past_lens"  # [B] int32: cached tokens per row before this call
LOGITS_INDEX = "logits_index"  # prefill only, [B, K] int64: the positions of S to return logits for
# A vision-language export: its prefill graph (never decode) also takes the image embeddings of the image tokens among
# its input_ids, row-major (row 0's image tokens in order, then row 1's...), one row of IMAGE_FEATURES per token
# equal to the image token id; [0, hidden] when there are none. The graph writes them over those tokens' embeddings.
IMAGE_FEATURES = "image_features"  # [N, hidden] float (the export's dtype)
# M-RoPE (Qwen-VL's temporal, height, width positions): prefill takes each token's three as get_rope_index computes
# them; decode a per-row offset, the new token's three being past_lens[b] + ROPE_DELTAS[b] (0 for a text row). A text
# call passes past_lens[b] + t + ROPE_DELTAS[b] in all three.
POSITION_IDS = "position_ids"  # prefill only, [3, B, S] int64
ROPE_DELTAS = "rope_deltas"  # decode only, [B] int64
# The third graph of a vision-language export, `vision.onnx`: images in, the image tokens' embeddings out.
VISION = "vision"
PIXEL_VALUES = "pixel_values"  # [images, channels, height, width] float: preprocessed (runtime/media/)
VISION_EXTRA_OUTPUTS = ("image_newline",)  # beside IMAGE_FEATURES, for a tiled family's pack (LLaVA-NeXT's row end)
# The fixed-size image processors whose pipeline the runtime replays without torch (runtime/media/preprocess.py).
IMAGE_PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor", "GotOcr2ImageProcessor", "VideoLlavaImageProcessor",
                    "DeepseekVLImageProcessor", "JanusImageProcessor", "Gemma3ImageProcessor")
# Speculation's head graph, `draft.onnx` (an EAGLE-3 head or a checkpoint's MTP layer, manifest record "draft"):
# one decoder layer with its own KV cache (the contract below, layers 0..n-1 of the head, `past_lens` as ever).
# Its cached position p holds the pair (token p + 1, the target's hidden state at p) and predicts token p + 2.
DRAFT = "draft"
DRAFT_KINDS = ("eagle3", "mtp")
# With a head attached, the target's prefill and decode graphs also output the hidden states the head reads,
# [B, S, Dt] for every position of S (EAGLE-3: three layers' outputs concatenated, Dt = 3 * hidden; MTP: the final
# normed hidden state, Dt = hidden). The head takes them as its input of the same name.
TARGET_HIDDEN = "target_hidden"
# The head's own input [B, S, H] for chained drafts: its previous `hidden_out`. The head adds its projection of
# TARGET_HIDDEN (EAGLE-3's fc, bias-free; MTP: the identity) to DRAFT_HIDDEN, so the runtime passes zeros for the
# one it does not use (target states for positions the target verified, the head's own for drafted ones).
DRAFT_HIDDEN = "draft_hidden"
HIDDEN_OUT = "hidden_out"  # head output [B, S, H]: its hidden state before the final norm (the next DRAFT_HIDDEN)
# Head outputs: LOGITS [B, S, Vd] over its own vocabulary, and TOKEN_MAP [Vd] int64, the target id of each draft id
# (EAGLE-3's d2t applied: d + d2t[d]; arange(V) for a head over the target's vocabulary).
TOKEN_MAP = "token_map"
LOGITS = "logits"  # prefill [B, K, V], decode [B, V]
# Inside the decode graph: the prefill graph's per-position logits [B, 1, V] before the squeeze.
# Bindable on ONNX Runtime, so a session of the prefill graph can serve decode steps.
LOGITS_POSITIONS = "logits_positions"
KV_KINDS = ("key", "value")
# A recurrent or linear-attention layer's fixed-size state per row, by kind and index (`conv0`: a
# short convolution's last inputs, `recurrent0`: an SSM / linear-attention state matrix). Bound in
# place like the KV buffers: the graph reads `past_conv0.{layer}` and writes `present_conv0.{layer}`.
STATE_KIND = re.compile(r"^(conv|recurrent)(\d+)$")
_CACHE_NAME = re.compile(r"^(past|present)_(key|value|(?:conv|recurrent)\d+)\.(\d+)$")


def cache_input(kind: str, layer: int) -> str:
    """`past_key.{layer}` / `past_value.{layer}` (/ `past_conv0.{layer}` ...): the cache a graph reads."""
    return f"past_{kind}.{layer}"


def cache_output(kind: str, layer: int) -> str:
    """`present_key.{layer}` / `present_value.{layer}` (...): the same buffer, bound as the graph's output."""
    return f"present_{kind}.{layer}"


def parse_cache_name(name: str) -> tuple[str, str, int] | None:
    """("past" | "present", kind, layer) for a cache IO name (kind "key", "value" or a state kind), None for
    any other name."""
    match = _CACHE_NAME.match(name)
    return (match[1], match[2], int(match[3])) if match else None


def buffer_name(kind: str, layer: int) -> str:
    """The key of a slot's cache buffer (`key.3`): past and present of one layer and kind share it."""
    return f"{kind}.{layer}"


class StateSpec(NamedTuple):
    """One recurrent state buffer of a layer: `[B, *shape]` of `dtype`, whatever the capacity."""

    layer: int
    kind: str  # STATE_KIND: "conv0", "recurrent0", ...
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class KVLayout:
    """The cache of every layer (DESIGN.md, "The KV cache contract"). An attention layer keeps one key and
    one value buffer `[B, H_kv, C, D]` (BNSH) of `dtype`; the capacity C is chosen by the runtime, up to
    `max_capacity`. Every layer has `num_kv_heads` heads of `head_dim`, unless `layers` gives each layer's
    own (H_kv, D) (Gemma 4: its full-attention layers have twice the sliding layers' head size), or None
    for a layer that keeps no KV (a recurrent layer of a hybrid); `num_kv_heads` / `head_dim` are then the
    first attention layer's (1 where there is none). Recurrent and linear-attention layers keep `states`:
    fixed-size buffers per row, read and written in place by both graphs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a value of DTYPES, or of KV_CACHE_DTYPES for a quantised cache
    max_capacity: int
    layout: str = "BNSH"
    # per layer (H_kv, D), None: no KV; () = every layer (num_kv_heads, head_dim)
    layers: tuple[tuple[int, int] | None, ...] = ()
    states: tuple[StateSpec, ...] = ()

    @classmethod
    def per_layer(cls, shapes: list[tuple[int, int] | None], dtype: str, max_capacity: int,
                  states: tuple[StateSpec, ...] = ()) -> KVLayout:
        """The layout of layers of these (H_kv, D) (None: no KV): uniform when they are all alike."""
        alike = len(set(shapes)) == 1 and shapes[0] is not None
        first = next((shape for shape in shapes if shape is not None), (1, 1))
        return cls(len(shapes), int(first[0]), int(first[1]), dtype, max_capacity,
                   layers=() if alike else tuple(None if s is None else (int(s[0]), int(s[1])) for s in shapes),
                   states=tuple(states))

    def has_kv(self, layer: int) -> bool:
        return not self.layers or self.layers[layer] is not None

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(H_kv, D) of `layer`'s key and value buffers."""
        shape = self.layers[layer] if self.layers else (self.num_kv_heads, self.head_dim)
        if shape is None:
            raise ValueError(f"layer {layer} keeps no KV cache")
        return shape

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(H_kv, D) of every layer that keeps a KV cache."""
        return [self.layer_shape(layer) for layer in range(self.num_layers) if self.has_kv(layer)]

    def shape(self, batch: int, capacity: int, layer: int = 0) -> tuple[int, int, int, int]:
        heads, head_dim = self.layer_shape(layer)
        return (batch, heads, capacity, head_dim)

    def state(self, layer: int, kind: str) -> StateSpec:
        return next(spec for spec in self.states if (spec.layer, spec.kind) == (layer, kind))

    def buffer_shape(self, batch: int, capacity: int, layer: int, kind: str) -> tuple[int, ...]:
        """The shape of any cache buffer: a key or value's [B, H_kv, C, D], a state's [B, *shape]."""
        if kind in KV_KINDS:
            return self.shape(batch, capacity, layer)
        return (batch, *self.state(layer, kind).shape)

    def buffer_dtype(self, layer: int, kind: str) -> str:
        return self.dtype if kind in KV_KINDS else self.state(layer, kind).dtype

    def buffer_bytes(self, batch: int, capacity: int, layer: int, kind: str = "key") -> int:
        """Bytes of one buffer (`layer`'s key, value or state `kind`)."""
        return math.prod(self.buffer_shape(batch, capacity, layer, kind)) * ITEMSIZE[self.buffer_dtype(layer, kind)]

    def bytes(self, batch: int, capacity: int) -> int:
        """Bytes of every buffer of a cache of this batch and capacity."""
        return sum(self.buffer_bytes(batch, capacity, layer, kind) for layer, kind in self.buffers())

    def buffers(self) -> list[tuple[int, str]]:
        """(layer, kind) in graph order: key.0, value.0, key.1, ... with each layer's states after its KV."""
        out = []
        for layer in range(self.num_layers):
            if self.has_kv(layer):
                out += [(layer, kind) for kind in KV_KINDS]
            out += [(layer, spec.kind) for spec in self.states if spec.layer == layer]
        return out

    def layer_buffers(self, layer: int) -> list[str]:
        """The kinds of `layer`'s buffers, in buffer order (what a row copy of the layer holds)."""
        return [kind for at, kind in self.buffers() if at == layer]

    def cache_inputs(self) -> list[str]:
        return [cache_input(kind, layer) for layer, kind in self.buffers()]

    def cache_outputs(self) -> list[str]:
        return [cache_output(kind, layer) for layer, kind in self.buffers()]

    def to_manifest(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("layers", "states")}
        if self.layers:  # only where layers differ, so a uniform export's manifest is as before
            out["layers"] = [None if shape is None else {"num_kv_heads": shape[0], "head_dim": shape[1]}
                             for shape in self.layers]
        if self.states:
            out["states"] = [{"layer": s.layer, "kind": s.kind, "shape": list(s.shape), "dtype": s.dtype}
                             for s in self.states]
        return out

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> KVLayout:
        """The `kv_cache` entry of a manifest, checked (ManifestError names the bad field)."""
        kv = manifest.get("kv_cache")
        if not isinstance(kv, Mapping):
            raise ManifestError("the manifest's 'kv_cache' must be an object; re-run the export")
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_capacity"):
            value = kv.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ManifestError(f"kv_cache.{name} must be a positive integer, got {value!r}; re-run the export")
        if kv["max_capacity"] > MAX_CONTEXT:  # cache buckets are planned up to it
            raise ManifestError(f"kv_cache.max_capacity {kv['max_capacity']} is beyond any real context (at most "
                                f"{MAX_CONTEXT}); the manifest was crafted or corrupted: re-run the export")
        if kv.get("dtype") not in ITEMSIZE:
            raise ManifestError(
                f"kv_cache.dtype must be one of {', '.join(ITEMSIZE)}, got {kv.get('dtype')!r}; re-run the export"
            )
        if kv.get("layout", "BNSH") != "BNSH":
            raise ManifestError(f"kv_cache.layout {kv.get('layout')!r} is not BNSH; re-run the export")
        layers = _manifest_layers(kv.get("layers"), kv["num_layers"])
        states = _manifest_states(kv.get("states"), kv["num_layers"])
        return cls(kv["num_layers"], kv["num_kv_heads"], kv["head_dim"], kv["dtype"], kv["max_capacity"],
                   layers=layers, states=states)


MAX_HEAD_SIZE = 1 << 16  # far beyond any head (MLA's 576), far below a crafted 1e9 that sizes a buffer


def _manifest_layers(layers: Any, num_layers: int) -> tuple[tuple[int, int] | None, ...]:
    """kv_cache.layers: absent, or one {"num_kv_heads", "head_dim"} (or null: no KV) per layer."""
    if layers is None:
        return ()
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ManifestError(f"kv_cache.layers must be a list of {num_layers} entries (one per layer), got "
                            f"{layers!r:.80}; re-run the export")
    out: list[tuple[int, int] | None] = []
    for i, entry in enumerate(layers):
        if entry is None:
            out.append(None)
            continue
        values = [entry.get(name) if isinstance(entry, Mapping) else None for name in ("num_kv_heads", "head_dim")]
        if not all(is_int(value) and 1 <= value <= MAX_HEAD_SIZE for value in values):
            raise ManifestError(f"kv_cache.layers[{i}] must be {{\"num_kv_heads\": N, \"head_dim\": D}} with positive "
                                f"integers, got {entry!r:.80}; re-run the export")
        out.append((values[0], values[1]))
    return tuple(out)


MAX_STATE_ELEMENTS = 1 << 28  # elements of one row's state: far beyond a real one (Mamba 2: ~1M)


def _manifest_states(states: Any, num_layers: int) -> tuple[StateSpec, ...]:
    """kv_cache.states: absent, or [{"layer", "kind", "shape", "dtype"}, ...], checked."""
    if states is None:
        return ()
    if not isinstance(states, list):
        raise ManifestError(f"kv_cache.states must be a list, got {states!r:.80}; re-run the export")
    out = []
    for i, entry in enumerate(states):
        ok = isinstance(entry, Mapping) and is_int(entry.get("layer")) and 0 <= entry["layer"] < num_layers \
            and isinstance(entry.get("kind"), str) and STATE_KIND.match(entry["kind"]) is not None \
            and isinstance(entry.get("shape"), list) and all(is_int(d) and d >= 1 for d in entry["shape"]) \
            and math.prod(entry["shape"]) <= MAX_STATE_ELEMENTS and entry.get("dtype") in ITEMSIZE
        if not ok:
            raise ManifestError(f"kv_cache.states[{i}] must be {{\"layer\", \"kind\", \"shape\", \"dtype\"}} (a layer "
                                f"index, conv<N> or recurrent<N>, positive sizes, a cache dtype), got {entry!r:.120}; "
                                "re-run the export")
        out.append(StateSpec(entry["layer"], entry["kind"], tuple(entry["shape"]), entry["dtype"]))
    return tuple(out)


MIN_BUCKET = 64  # the smallest cache capacity the runtime allocates


def capacity_buckets(max_capacity: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Capacities a cache is allocated at: powers of two from `smallest`, then `max_capacity`. Requests
    of different lengths then share buffers, bindings (and CUDA graphs, TensorRT profiles) while
    never holding more than twice the positions they need."""
    buckets = []
    size = smallest
    while size < max_capacity:
        buckets.append(size)
        size *= 2
    buckets.append(max_capacity)
    return tuple(buckets)


@dataclass(frozen=True)
class GraphIO:
    """The input and output names of one graph, in graph order."""

    phase: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def of(cls, phase: str, layout: KVLayout, images: bool = False, hidden: bool = False,
           mrope: bool = False) -> GraphIO:
        """A phase's IO; `images`: the prefill graph of a vision-language export (it takes IMAGE_FEATURES);
        `hidden`: an export with a speculation head (both graphs also output TARGET_HIDDEN, last); `mrope`: an
        export with multimodal positions (prefill takes POSITION_IDS, decode ROPE_DELTAS)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        head = (INPUT_IDS, PAST_LENS) + ((LOGITS_INDEX,) if phase == "prefill" else ())
        head += (IMAGE_FEATURES,) if images and phase == "prefill" else ()
        head += ((POSITION_IDS if phase == "prefill" else ROPE_DELTAS),) if mrope else ()
        outputs = (LOGITS, *layout.cache_outputs()) + ((TARGET_HIDDEN,) if hidden else ())
        return cls(phase, head + tuple(layout.cache_inputs()), outputs)

    @classmethod
    def of_manifest(cls, phase: str, layout: KVLayout, manifest: Mapping[str, Any]) -> GraphIO:
        """A phase's IO as an export's manifest declares it: images and multimodal positions from its `vision`
        record, TARGET_HIDDEN from its `draft` record."""
        vision = manifest.get("vision")
        return cls.of(phase, layout, images=vision is not None, hidden=manifest.get(DRAFT) is not None,
                      mrope=isinstance(vision, Mapping) and vision.get("positions") == "mrope")

    @classmethod
    def draft(cls, layout: KVLayout) -> GraphIO:
        """The speculation head's graph IO (DRAFT): `layout` is the head's own KV cache (manifest draft.kv_cache)."""
        return cls(DRAFT, (INPUT_IDS, TARGET_HIDDEN, DRAFT_HIDDEN, PAST_LENS, *layout.cache_inputs()),
                   (LOGITS, HIDDEN_OUT, TOKEN_MAP, *layout.cache_outputs()))

    @classmethod
    def vision(cls, tower_inputs: tuple[str, ...] = (), extra_outputs: tuple[str, ...] = ()) -> GraphIO:
        """The vision graph's IO: preprocessed images (or one image's tiles) in, their image tokens' embeddings out
        ([images * tokens, hidden]); a patch tower's other arrays, a tiled family's VISION_EXTRA_OUTPUTS."""
        return cls(VISION, (PIXEL_VALUES, *tower_inputs), (IMAGE_FEATURES, *extra_outputs))

    def check(self, inputs: list[str], outputs: list[str], where: str) -> None:
        """ManifestError unless `inputs` / `outputs` (any order) are exactly this graph's."""
        if sorted(inputs) != sorted(self.inputs) or sorted(outputs) != sorted(self.outputs):
            raise ManifestError(
                f"{where}: the {self.phase} graph IO does not follow the KV cache contract: inputs {inputs}, outputs "
                f"{outputs}; expected inputs {list(self.inputs)} and outputs {list(self.outputs)}; re-run the export"
            )


# -- the fused attention op ----------------------------------------------------------------------
# The op's inputs, outputs and attributes, in this order everywhere: the torch op, the references,
# the ONNX node, the Triton kernel's launch plan, the TensorRT plugin and the CPU emulation.
ATTENTION_INPUTS = ("q", "k", "v", "past_key", "past_value", "past_lens")
ATTENTION_OUTPUTS = ("out", "present_key", "present_value")
# The canonical node's optional inputs, after ATTENTION_INPUTS. `sinks` [H]: one learned logit per query
# head that joins every row's softmax and takes probability mass without adding a value (gpt-oss, Flint,
# Granite SWA). The `ort` and `onnx` lowerings carry it; the TensorRT kernel has no sinks, so the `trt`
# target refuses a model that uses them (the plugin's inputs stay ATTENTION_INPUTS). `alibi_slopes` [H] fp32:
# ALiBi (BLOOM, MPT), the score of query position i for key position j gains slope_h * (j - i); the `trt`
# target refuses it the same way. `block_ids` [B, S] int64 (prefill; Gemma 3's images): 0 a causal token, k > 0 image
# block k, whose tokens also see its later ones (exporter/image_blocks.py; the runtime never splits a block).
# `attention_bias` [B or 1, H, S, C]: added to the scores at each cache position (T5's relative bias; `trt` refuses).
ATTENTION_OPTIONAL_INPUTS = ("sinks", "alibi_slopes", "block_ids", "attention_bias")


@dataclass(frozen=True)
class AttentionAttrs:
    """The fused attention node's attributes. Token t of row b attends cache positions
    `0 .. past_lens[b] + t` (the last `sliding_window` of them when it is > 0); `softcap` > 0 caps
    the scores as `softcap * tanh(score / softcap)`."""

    num_heads: int
    kv_num_heads: int
    scale: float
    softcap: float = 0.0
    sliding_window: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AttentionAttrs:
        """From a node's attributes (extra keys, such as the plugin's, are ignored)."""
        return cls(int(values["num_heads"]), int(values["kv_num_heads"]), float(values["scale"]),
                   float(values.get("softcap", 0.0)), int(values.get("sliding_window", 0)))

    @classmethod
    def types(cls) -> dict[str, type]:
        """Each attribute's Python type (int or float), by name: what schemas and op bridges declare."""
        hints = get_type_hints(cls)
        return {name: hints[name] for name in cls.names()}


def attention_parameters(*, sinks: bool = False, spelled: bool = True) -> tuple[str, ...]:
    """The op's parameters in contract order: ATTENTION_INPUTS, then ATTENTION_OPTIONAL_INPUTS when carried, then the
    attributes spelled out (AttentionAttrs.names(), for torch.library, onnxscript and tensorrt.plugin)
    or as one `attrs` (the Python implementations)."""
    return ATTENTION_INPUTS + (ATTENTION_OPTIONAL_INPUTS if sinks else ()) + (
        AttentionAttrs.names() if spelled else ("attrs",))


def check_attention_parameters(fn: Callable[..., Any], expected: tuple[str, ...]) -> None:
    """Refuse, at import, an implementation of the attention op whose positional parameters are not
    `expected` (built from the contract): a parameter list written out by hand cannot drift unseen.
    Keyword-only parameters (launch options) and **kwargs (node attributes) are not part of the op."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in positional)
    if names != expected:
        raise RuntimeError(f"{fn.__module__}.{fn.__qualname__} takes {names}, but the attention op's "
                           f"contract is {expected}")


@dataclass(frozen=True)
class OpIdentity:
    """The canonical node every export traces to, before a target's lowering."""

    domain: str
    op_type: str
    version: int


@dataclass(frozen=True)
class PluginIdentity:
    """How TensorRT's ONNX parser finds kvforge's plugin: by op type plus the node attributes
    plugin_namespace / plugin_version (it ignores the domain). The node's domain is the one
    onnxruntime-extensions' Python ops use, so the CPU emulation serves the very same node."""

    name: str
    namespace: str
    version: str
    onnx_domain: str

    @property
    def id(self) -> str:
        """`namespace::name`, the key of `tensorrt.plugin`'s registry."""
        return f"{self.namespace}::{self.name}"

    def node_attributes(self) -> dict[str, str]:
        return {"plugin_namespace": self.namespace, "plugin_version": self.version}


CANONICAL_OP = OpIdentity(domain="kvforge", op_type="KVCacheAttention", version=1)
# The canonical mixture-of-experts node (plugins/moe_op.py defines its inputs and semantics).
MOE_OP = OpIdentity(domain="kvforge", op_type="MoEExperts", version=1)
PLUGIN = PluginIdentity(name="KVCacheAttention", namespace="kvforge", version="1", onnx_domain="ai.onnx.contrib")
