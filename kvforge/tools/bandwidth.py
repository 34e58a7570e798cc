"""Decode speed as a share of the memory-bandwidth limit (DESIGN.md, "Real sizes"): at small batches a decode
step is bound by memory, so the fastest it can be is the bytes it must read over the device's bandwidth.
The share = (bytes read per step / step time) / bandwidth, the figure that compares decoders across sizes
(the best reach about 80% at batch 1).

Bytes read per step: the weights a step reads (kvforge/tools/graph_reads.py: every matrix and the lm_head
whole, a looked-up embedding one row per token) plus the KV cache it attends over (per attention layer, K and
V of kv_heads x head_dim x the context x the cache's element size, per row; recurrent states whole), with
shapes from the manifest's KV layout. The bandwidth: on a GPU a datasheet figure looked up by the name
nvidia-smi reports; on a CPU the bench's measured probe; `--mem-bandwidth GB/s` overrides either.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvforge.core.contract import DTYPES, ITEMSIZE, KV_KINDS, KVLayout
from kvforge.core.errors import InputError
from kvforge.core.manifest import resolve_in_folder
from kvforge.tools.graph_reads import step_weight_reads

# Peak memory bandwidth in GB/s by the GPU's name as nvidia-smi reports it (most specific pattern first).
# Approximate: the vendors' datasheet figures (NVIDIA's product pages), which clocks and boards vary around.
GPU_BANDWIDTH_GBPS: tuple[tuple[str, str, float], ...] = (
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 3900.0),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 2000.0),
    (r"\bH100\b", "H100 SXM", 3350.0),  # "NVIDIA H100 80GB HBM3"
    (r"\bH200\b", "H200", 4800.0),  # SXM and NVL alike; not GH200 (its own figures)
    (r"\bB200\b", "B200", 8000.0),
    (r"\bA100\b(?=.*\bPCIe\b).*\b80GB\b", "A100 80GB PCIe", 1935.0),
    (r"\bA100\b.*\b80GB\b", "A100 SXM 80GB", 2039.0),  # "NVIDIA A100-SXM4-80GB"
    (r"\bA100\b.*\b40GB\b", "A100 40GB", 1555.0),
    (r"\bL40S?\b", "L40S / L40", 864.0),
    (r"\bL4\b", "L4", 300.0),
    (r"\bRTX 4090\b", "GeForce RTX 4090", 1008.0),
    (r"\bRTX 5090\b", "GeForce RTX 5090", 1792.0),
    (r"\bA10G?\b", "A10 / A10G", 600.0),
)
# Laptop parts share desktop names but not their memory: never matched.
_MOBILE = re.compile(r"laptop|max-q|mobile", re.IGNORECASE)


def gpu_bandwidth_gbps(name: str) -> tuple[float | None, str]:
    """The datasheet bandwidth of the GPU nvidia-smi calls `name`, and which table row gave it; (None, why)
    for a GPU the table does not know."""
    if not _MOBILE.search(name):
        for pattern, product, gbps in GPU_BANDWIDTH_GBPS:
            if re.search(pattern, name, re.IGNORECASE):
                return gbps, f"{product}: about {gbps:.0f} GB/s (datasheet)"
    return None, f"no bandwidth figure for GPU {name!r} in kvforge's table: give --mem-bandwidth GB/s"


def parse_mem_bandwidth(text: str | float | None) -> float | None:
    """`--mem-bandwidth`'s value in GB/s (None: not given); InputError unless a positive, finite number."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"--mem-bandwidth takes the memory bandwidth in GB/s, a positive number (e.g. 3350); "
                         f"got {text!r}")
    return value


def gpu_bandwidth_choice(override: float | None, gpu_name: str | None) -> dict[str, Any]:
    """The bandwidth a GPU benchmark divides by: `--mem-bandwidth`, else the table's figure for the GPU;
    `mem_bandwidth_gbps` None (with `mem_bandwidth_note` saying why) when neither is known."""
    if override is not None:
        return {"mem_bandwidth_gbps": override, "mem_bandwidth_source": "--mem-bandwidth", "mem_bandwidth_note": None}
    if gpu_name is None:
        return {"mem_bandwidth_gbps": None, "mem_bandwidth_source": None,
                "mem_bandwidth_note": "the GPU's name is unknown (nvidia-smi did not answer): give --mem-bandwidth GB/s"}
    gbps, note = gpu_bandwidth_gbps(gpu_name)
    return {"mem_bandwidth_gbps": gbps, "mem_bandwidth_source": f"table: {gpu_name}" if gbps else None,
            "mem_bandwidth_note": note}


def mean_context(prompt_lens: Sequence[int], new_tokens: int) -> float:
    """The mean context a decode step attends over, per row: prompt + new_tokens / 2 (the steps after the
    prefill's token attend prompt + 1 .. prompt + new - 1 positions), averaged over the rows' prompts."""
    return sum(prompt_lens) / len(prompt_lens) + new_tokens / 2


def kv_bytes_read(layout: KVLayout, batch: int, context: float, itemsize: float | None = None) -> tuple[float, float]:
    """(K/V bytes, state bytes) a decode step reads: every attention layer's key and value over `context`
    positions per row, every recurrent state whole. `itemsize`: another system's cache element size."""
    kv = states = 0.0
    for layer, kind in layout.buffers():
        if kind in KV_KINDS:
            heads, head_dim = layout.layer_shape(layer)
            kv += batch * heads * head_dim * context * (itemsize or ITEMSIZE[layout.dtype])
        else:
            states += layout.buffer_bytes(batch, 1, layer, kind)
    return kv, states


def bytes_per_decode_step(manifest: dict[str, Any], export_dir: str | Path, batch: int, context: float, *,
                          dtype: str | None = None, graph: str | Path | None = None) -> dict[str, Any]:
    """The bytes one decode step of `batch` rows at `context` positions per row reads: `weights_bytes`,
    `kv_bytes`, `state_bytes`, `total_bytes` (see the module docstring), from the export's decode graph and
    manifest. For a peer: `dtype` ("fp32") costs the cache, and without `graph` the same weight elements, at
    that element size (Hugging Face running the source model); `graph` takes the weights another decode graph
    reads (onnxruntime-genai's model)."""
    export_dir = Path(export_dir)
    path = Path(graph) if graph is not None else resolve_in_folder(
        export_dir, manifest["graphs"]["decode"]["file"], "the decode graph")
    reads = step_weight_reads(path.read_bytes(), batch)
    itemsize = ITEMSIZE[DTYPES[dtype]] if dtype is not None else None
    weights = reads["weight_elements"] * itemsize if itemsize is not None and graph is None else reads["weights_bytes"]
    kv, states = kv_bytes_read(KVLayout.from_manifest(manifest), batch, context, itemsize)
    return {"batch": batch, "context_tokens": context, "weights_bytes": round(weights), "kv_bytes": round(kv),
            "state_bytes": round(states), "total_bytes": round(weights + kv + states),
            "weight_elements": reads["weight_elements"], "dtype": dtype or manifest["dtype"]}


def genai_decoder_graph(model_dir: str | Path) -> Path:
    """onnxruntime-genai's decoder graph in its model folder (genai_config.json names it)."""
    config = json.loads((Path(model_dir) / "genai_config.json").read_text())
    return Path(model_dir) / config["model"]["decoder"].get("filename", "model.onnx")


def share_pct(step_bytes: float, step_ms: float, gbps: float | None) -> float | None:
    """Bytes per step over the step's time, as a percentage of `gbps` (None without a bandwidth)."""
    if gbps is None or step_ms <= 0:
        return None
    return 100.0 * step_bytes / (step_ms / 1e3) / (gbps * 1e9)


def bandwidth_probe(threads: int) -> Callable[[], float]:
    """A probe of the GB/s that ONNX Runtime streams weights at on this machine: a
    [1, 4096] x [4096, 8192] fp32 MatMul (128 MB of weights, far over the caches), 30 runs, the 90th
    percentile of their throughput (a ceiling). This host's bandwidth drifts between 25 and 40 GB/s
    over minutes (shared machine), so the bench calls the probe in every round, beside the systems."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((4096, 8192)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8192])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options)
    x = np.ones((1, 4096), np.float32)

    def probe() -> float:
        for _ in range(3):
            session.run(None, {"x": x})
        rates = []
        for _ in range(30):
            start = time.perf_counter()
            session.run(None, {"x": x})
            rates.append(weight.nbytes / (time.perf_counter() - start) / 1e9)
        return float(np.percentile(rates, 90))

    return probe
