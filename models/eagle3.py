"""EAGLE-3 speculation heads as they are published, read and checked against a target (`kvforge export --eagle`).

Two published forms of the same head (one decoder layer whose attention reads [embedding, hidden] of width 2H):

- speculators (vllm-project/speculators, `Eagle3SpeculatorConfig`): config.json with `speculators_model_type:
  "eagle3"`, the layer's Llama config under `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`,
  optionally `target_hidden_size` and `eagle_aux_hidden_state_layer_ids`; the layer's weights are `layers.0.*`.
- EAGLE (SafeAILab/EAGLE, eagle/model/cnets.py `Model`): config.json is the layer's Llama config plus
  `draft_vocab_size` (optionally `target_hidden_size`); the layer's weights are `midlayer.*`.

Both: `fc.weight` [H, n * Ht] (bias-free), the layer's `input_layernorm` (the token embedding), `hidden_norm` (the
fused hidden state), `self_attn.{q,k,v}_proj` over 2H inputs, `o_proj`, `post_attention_layernorm`, `mlp`; then
`norm`, `lm_head` [Vd, H], `d2t` [Vd] (target id = d + d2t[d]) and `t2d` [V] (bool); `embed_tokens.weight` only
where the head keeps its own, else the target's embedding table is used (cnets.py loads the target's).

Which target states the head reads (the aux layer ids): EAGLE's target models (modeling_llama_kv.py) append the
hidden state *entering* decoder layer idx for idx in {2, L // 2, L - 3}, in layer order; vLLM collects
`aux_hidden_states` the same way (before `layer(...)` runs) for the ids of `eagle_aux_hidden_state_layer_ids`. So an
id i names the input of layer i, which is Hugging Face's `output_hidden_states[i]` (0: the embeddings), and the
states are concatenated in ascending layer order. Ids must be distinct and below the target's layer count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError

LAYER_PREFIXES = {"speculators": "layers.0.", "eagle": "midlayer."}
LAYER_WEIGHTS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_OPTIONAL = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")
HEAD_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
HEAD_OPTIONAL = ("t2d", "embed_tokens.weight")
KNOWN_FORMS = ("speculators' Eagle3 config (speculators_model_type \"eagle3\" with transformer_layer_config) or "
               "EAGLE's (a Llama config with draft_vocab_size), with fc / midlayer.* or layers.0.* / norm / lm_head / "
               "d2t weights in safetensors")


@dataclass(frozen=True)
class Eagle3Head:
    """One EAGLE-3 head, read and checked against its target. `weights` by canonical name: `fc.weight`,
    `layer.<name>` for the decoder layer's, `norm.weight`, `lm_head.weight`, `d2t`, and `t2d` /
    `embed_tokens.weight` where the checkpoint has them (fp32 torch tensors, d2t int64)."""

    folder: Path
    form: str  # "speculators" | "eagle"
    layer_config: dict[str, Any]  # the decoder layer's Llama config (transformers' LlamaConfig fields)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    target_hidden_size: int  # n * the target's hidden size: the width of TARGET_HIDDEN
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    weights: dict[str, Any] = field(repr=False)

    def llama_config(self) -> Any:
        """The layer's transformers LlamaConfig (its RoPE, norms' eps, MLP activation)."""
        from transformers import LlamaConfig

        values = {k: v for k, v in self.layer_config.items() if k not in ("architectures", "model_type")}
        values.update(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                      num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, num_hidden_layers=1)
        return LlamaConfig(**values)

    def token_map(self) -> Any:
        """[Vd] int64: the target id of each draft id, d + d2t[d] (cnets.py: `topk_index + self.d2t[topk_index]`)."""
        import torch

        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.weights["d2t"].to(torch.int64)


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise InputError(f"--eagle {folder}: not a folder; pass an EAGLE-3 head's folder (config.json and safetensors)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise InputError(f"unknown head format in {folder}: no readable config.json ({type(err).__name__}); kvforge "
                         f"reads {KNOWN_FORMS}") from None
    if not isinstance(config, dict):
        raise InputError(f"unknown head format in {folder}: config.json is not an object; kvforge reads {KNOWN_FORMS}")
    return config


def _form(folder: Path, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """("speculators" | "eagle", the layer's config), or the one-line refusal of anything else."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        layer = config.get("transformer_layer_config")
        if kind != "eagle3" or not isinstance(layer, dict) or "draft_vocab_size" not in config:
            raise InputError(f"unknown head format in {folder}: speculators_model_type {kind!r} (kvforge reads "
                             f"{KNOWN_FORMS})")
        if layer.get("model_type", "llama") != "llama":  # speculators' Qwen3-layer heads add q/k norms
            raise InputError(f"unknown head format in {folder}: a {layer.get('model_type')!r} decoder layer (kvforge "
                             "reads EAGLE-3 heads of one Llama layer)")
        return "speculators", layer
    if "draft_vocab_size" in config and "hidden_size" in config:
        return "eagle", config
    raise InputError(f"unknown head format in {folder}: its config.json is neither of {KNOWN_FORMS}")


def _load_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        why = f" (it has {', '.join(pickled)}: pickles, which kvforge does not load; convert them to safetensors)" \
            if pickled else ""
        raise InputError(f"unknown head format in {folder}: no *.safetensors weights{why}")
    weights: dict[str, Any] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as err:  # noqa: BLE001 - safetensors' own errors name no file
            raise InputError(f"{file} is not a readable safetensors file ({type(err).__name__}: {err})") from None
    return weights


def _canonical(folder: Path, weights: dict[str, Any]) -> dict[str, Any]:
    """The weights under kvforge's names (layer prefix `layer.`), refusing missing or unknown ones."""
    prefixes = [p for p in LAYER_PREFIXES.values() if any(name.startswith(p) for name in weights)]
    if len(prefixes) != 1:
        raise InputError(f"unknown head format in {folder}: its decoder layer's weights are not under exactly one of "
                         f"{', '.join(LAYER_PREFIXES.values())} (found {sorted(weights)[:6]})")
    prefix, out, unknown = prefixes[0], {}, []
    for name, tensor in weights.items():
        short = name.removeprefix(prefix)
        if name.startswith(prefix) and short in LAYER_WEIGHTS + LAYER_OPTIONAL:
            out[f"layer.{short}"] = tensor
        elif name in HEAD_WEIGHTS + HEAD_OPTIONAL:
            out[name] = tensor
        else:
            unknown.append(name)
    missing = [n for n in HEAD_WEIGHTS if n not in out] + [f"{prefix}{n}" for n in LAYER_WEIGHTS if f"layer.{n}" not in out]
    if missing or unknown:
        raise InputError(f"unknown head format in {folder}: " + "; ".join(
            part for part in (f"missing {', '.join(missing)}" if missing else "",
                              f"weights kvforge does not read: {', '.join(sorted(unknown)[:4])}" if unknown else "")
            if part) + " (one decoder layer is read: a head of more layers is not supported)")
    return out


def _aux_ids(folder: Path, config: dict[str, Any], layers: int) -> tuple[int, ...]:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # EAGLE's target models: the inputs of layers 2, L // 2 and L - 3 (modeling_llama_kv.py)
        ids = sorted({2, layers // 2, layers - 3})
    if not isinstance(ids, list | tuple) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in ids):
        raise InputError(f"{folder}: eagle_aux_hidden_state_layer_ids must be a list of layer indices, got {ids!r}")
    if len(set(ids)) != len(ids) or not all(0 <= i < layers for i in ids):
        raise InputError(f"{folder}: aux layer ids {list(ids)} out of range: the target has {layers} layers, so "
                         f"they must be distinct indices in 0..{layers - 1}")
    return tuple(sorted(ids))


def read_eagle3_head(folder: str | Path, target_config: Any) -> Eagle3Head:
    """The head in `folder`, checked to fit the target (`target_config`: its transformers config); InputError in
    one line otherwise: an unknown format, aux layer ids out of range, sizes that do not fit."""
    import torch

    folder = Path(folder).absolute()
    config = _config(folder)
    form, layer = _form(folder, config)
    weights = _canonical(folder, _load_weights(folder))
    t_hidden, t_vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    ids = _aux_ids(folder, config, int(target_config.num_hidden_layers))
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        kv_heads = int(layer.get("num_key_value_heads") or heads)
        head_dim = int(layer.get("head_dim") or hidden // heads)
        draft_vocab = int(config["draft_vocab_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(f"unknown head format in {folder}: its layer config lacks {err}") from None
    fits = f"the head's hidden size {hidden} does not fit the target (hidden size {t_hidden}, {len(ids)} aux layers)"
    expected = {"fc.weight": (hidden, len(ids) * t_hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
                "d2t": (draft_vocab,), "layer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
                "layer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
                "layer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
                "layer.self_attn.o_proj.weight": (hidden, heads * head_dim), "t2d": (t_vocab,),
                "embed_tokens.weight": (t_vocab, hidden)}
    for name, shape in expected.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise InputError(f"{folder}: {fits}: {name} is {list(weights[name].shape)}, expected {list(shape)}")
    declared = config.get("target_hidden_size")
    if "embed_tokens.weight" not in weights and hidden != t_hidden or declared not in (None, t_hidden):
        raise InputError(f"{folder}: {fits}" + (": it has no embed_tokens, so it reads the target's embeddings"
                                                 if declared in (None, t_hidden) else f" (target_hidden_size {declared})"))
    out = {name: (t if name in ("d2t", "t2d") else t.to(torch.float32)) for name, t in weights.items()}
    out["d2t"] = out["d2t"].to(torch.int64)
    head = Eagle3Head(folder, form, dict(layer), hidden, heads, kv_heads, head_dim, draft_vocab, len(ids) * t_hidden,
                      ids, bool(config.get("norm_before_residual", False)), out)
    mapped = head.token_map()
    if int(mapped.min()) < 0 or int(mapped.max()) >= t_vocab:
        raise InputError(f"{folder}: d2t maps draft ids outside the target's vocabulary of {t_vocab} tokens")
    return head
