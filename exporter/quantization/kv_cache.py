"""`kvforge export --kv-cache int8`: an int8 KV cache with per-channel scales calibrated at export.

ONNX Runtime's GroupQueryAttention (CPU, 1.32) stores the cache as int8 when it is given `k_scale` /
`v_scale` (attribute k_quant_type / v_quant_type "PER_CHANNEL", kv_cache_bit_width 8): symmetric,
`q = clamp(round(x / scale), -128, 127)`, read back as `q * scale`, scales of shape [1, H_kv, 1, D].
kvforge calibrates one scale per layer, kind, kv head and channel here and stores them as constants
of both graphs, so the graph IO keeps its names and only the cache dtype changes.

Calibration: the model's own keys and values (after RoPE, what the fused op caches) on up to
CALIBRATION_TOKENS tokens of kvforge's shipped text after its first CALIBRATION_SKIP (the tokens
`kvforge parity` scores perplexity on, so the export's measured perplexity is on text it was not
calibrated on), through the export wrapper in eager mode. A
value channel's scale is its largest |x| / 127. A key channel that RoPE rotates with a partner
(rotate-half pairs (i, i + R/2) of the rotary dims R) gets the largest norm of the pair instead: the
norm does not change with the rotation angle, so positions far beyond the calibration text (8k)
cannot leave the calibrated range through the rotation. Values beyond the calibrated range saturate.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.contract import KVLayout
from kvforge.core.errors import InputError, UnsupportedModelError

QMAX = {"int8": 127}  # symmetric range used for the scale (ONNX Runtime clamps to [-128, 127])
CALIBRATION_TOKENS = 2048
CALIBRATION_SKIP = 1024  # kvforge.tools.parity.DEFAULT_PERPLEXITY_TOKENS (no import: exporter -> kvforge base only)
CALIBRATION_WINDOW = 512


def _calibration_text() -> Path:
    # The text kvforge's parity measures perplexity on (kvforge.tools.parity.PERPLEXITY_TEXT), shipped as data.
    return Path(str(importlib.resources.files("kvforge") / "data" / "perplexity.txt"))


def calibration_ids(model_dir: Path, max_positions: int) -> tuple[int, list[list[int]]]:
    """The first token used and windows of token ids of the shipped calibration text (the model's own
    tokenizer); a tokenizer that makes the text too short for skipping is calibrated from its start."""
    from tokenizers import Tokenizer

    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        raise InputError(f"--kv-cache calibrates its scales on text: {model_dir} has no tokenizer.json")
    ids = Tokenizer.from_file(str(file)).encode(_calibration_text().read_text()).ids
    window = min(CALIBRATION_WINDOW, max_positions)
    first = CALIBRATION_SKIP if len(ids) >= CALIBRATION_SKIP + window else 0
    ids = ids[first : first + CALIBRATION_TOKENS]
    return first, [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 2]


def channel_scales(cache: np.ndarray, qmax: int, rotary: int = 0) -> np.ndarray:
    """Per (kv head, channel) scales [1, H_kv, 1, D] of cache rows [N, H_kv, D]: max |x| / qmax, and for
    rotate-half pairs (i, i + rotary/2) the pair's largest norm / qmax for both channels."""
    amax = np.abs(cache).max(axis=0)  # [H_kv, D]
    if rotary:
        half = rotary // 2
        norm = np.sqrt(cache[..., :half] ** 2 + cache[..., half:rotary] ** 2).max(axis=0)  # [H_kv, half]
        amax = amax.copy()
        amax[:, :half] = norm
        amax[:, half:rotary] = norm
    scale = np.maximum(amax, 1e-8) / qmax  # a channel that is always 0 gets a harmless tiny scale
    return scale[None, :, None, :].astype(np.float32)


def calibrate(model: Any, config: Any, family: Any, layout: KVLayout, model_dir: Path, kv_dtype: str
              ) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, Any]]:
    """Per layer (key scales, value scales), each [1, H_kv, 1, D] float32, and the manifest record."""
    import torch

    from kvforge.exporter.wrapper import GraphWrapper

    if layout.layers:  # the record's one scale shape, and the rotary pairs, assume one head size
        attention = sum(layout.has_kv(i) for i in range(layout.num_layers))
        why = ("has no attention layers (it keeps recurrent state only)" if not attention else
               "mixes attention layers with recurrent-state layers" if layout.states else
               "has layers of different KV head counts or head sizes")
        raise UnsupportedModelError(f"{config.model_type}: --kv-cache {kv_dtype} quantises an attention KV cache "
                                    f"with one head count and head size in every layer, and this model {why}; "
                                    "export without --kv-cache")
    first, windows = calibration_ids(model_dir, int(config.max_position_embeddings))
    wrapper = GraphWrapper(model, "prefill", family).eval()
    rows: list[list[list[np.ndarray]]] = [[[], []] for _ in range(layout.num_layers)]  # layer -> kind -> [S, H, D]
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for window in windows:
            seq = len(window)
            past = [torch.zeros(layout.shape(1, seq), dtype=dtype) for _ in range(2 * layout.num_layers)]
            outputs = wrapper(torch.tensor([window]), torch.zeros(1, dtype=torch.int32),
                              torch.tensor([[seq - 1]]), *past)
            for index, present in enumerate(outputs[1:]):
                rows[index // 2][index % 2].append(present[0].float().numpy().transpose(1, 0, 2))  # [S, H, D]
    rotary = family.rotary(config, layout.head_dim)
    qmax = QMAX[kv_dtype]
    scales = [(channel_scales(np.concatenate(key), qmax, rotary), channel_scales(np.concatenate(value), qmax))
              for key, value in rows]
    record = {"dtype": kv_dtype, "scales": "per_channel", "scale_shape": [1, layout.num_kv_heads, 1, layout.head_dim],
              "symmetric": True, "rotary_pairs_share_scale": rotary,
              "calibration": {"text": _calibration_text().name, "first_token": first,
                              "tokens": sum(map(len, windows)),
                              "window": len(windows[0]) if windows else 0}}
    return scales, record
