"""Decode as a share of the memory-bandwidth limit (kvforge/tools/bandwidth.py, graph_reads.py): the bytes a
decode step reads, checked against hand computations from the tiny recipes' shapes and from hand-made graphs,
the GPU bandwidth table by real device names, and `--mem-bandwidth`'s checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import InputError
from kvforge.tools import bandwidth
from kvforge.tools.graph_reads import step_weight_reads

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

# The tiny recipes' shapes (models/recipes.py, _TINY): vocab 512, hidden 64, intermediate 128,
# 2 layers, 4 heads and 2 KV heads of head_dim 16, fp32.
V, H, FFN, L, HEADS, KV_HEADS, D, FP32 = 512, 64, 128, 2, 4, 2, 16, 4
# q, k, v, o and the gate/up/down matrices of one layer, in elements
LAYER = H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H + 3 * H * FFN
MATRICES = L * LAYER * FP32
LM_HEAD = V * H * FP32  # read whole every step
ROW = H * FP32  # one embedding row: what a lookup reads per token
# Norm gains ((2L+1) vectors of H) and biases: small, and the export may store equal ones once.
NORMS = (2 * L + 1) * H * FP32


def kv_bytes(batch: int, context: float) -> float:
    return L * 2 * KV_HEADS * D * context * FP32 * batch  # K and V of every layer


def _export_reads(folder, batch: int, context: float) -> dict:
    manifest = json.loads((folder / "kvforge.json").read_text())
    return bandwidth.bytes_per_decode_step(manifest, folder, batch, context)


def test_untied_export_reads_every_matrix_the_lm_head_and_one_embedding_row_per_token(exported) -> None:
    folder = exported("llama-tiny", "ort")
    for batch, context in ((1, 20.0), (3, 13.5)):
        reads = _export_reads(folder, batch, context)
        least = MATRICES + LM_HEAD + batch * ROW + H * FP32  # at least one norm vector
        assert least <= reads["weights_bytes"] <= least - H * FP32 + NORMS
        assert reads["kv_bytes"] == kv_bytes(batch, context) and reads["state_bytes"] == 0
        assert reads["total_bytes"] == reads["weights_bytes"] + reads["kv_bytes"]
    # Two more rows look up two more embedding rows and read their KV; the matrices are read once per step.
    one, three = _export_reads(folder, 1, 10), _export_reads(folder, 3, 10)
    assert three["weights_bytes"] - one["weights_bytes"] == 2 * ROW
    # Hugging Face in fp16: the same weights at 2 bytes an element, its cache at 2 bytes too.
    manifest = json.loads((folder / "kvforge.json").read_text())
    half = bandwidth.bytes_per_decode_step(manifest, folder, 1, 10, dtype="fp16")
    assert half["weights_bytes"] * 2 == one["weights_bytes"] and half["kv_bytes"] * 2 == kv_bytes(1, 10)


def test_tied_export_reads_the_lm_head_whole_once(exported) -> None:
    # Whether the export holds a tied embedding as one tensor (looked up and multiplied) or as a lookup table
    # beside the lm_head's transposed copy, a step reads the lm_head whole once and at most a row per token more.
    reads = _export_reads(exported("qwen2-tiny", "ort"), 2, 10)
    least = MATRICES + LM_HEAD
    biases = L * (HEADS * D + 2 * KV_HEADS * D) * FP32
    assert least < reads["weights_bytes"] <= least + 2 * ROW + NORMS + biases + 64  # + a few int64 shape constants
    assert reads["kv_bytes"] == kv_bytes(2, 10)


def _model(nodes, initializers, inputs=()) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.INT64, [1, 1]) for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(a, n) for n, a in initializers.items()])
    return helper.make_model(graph).SerializeToString()


def test_one_table_looked_up_and_used_as_the_lm_head_is_read_whole_once() -> None:
    table = np.zeros((10, 4), np.float32)  # 160 bytes
    tied = _model([helper.make_node("Gather", ["table", "ids"], ["x"]),
                   helper.make_node("Gemm", ["x", "table"], ["y"], transB=1)], {"table": table}, ["ids"])
    assert step_weight_reads(tied, batch=2)["weights_bytes"] == 160
    untied = _model([helper.make_node("Gather", ["table", "ids"], ["x"]),
                     helper.make_node("MatMul", ["x", "head"], ["y"])], {"table": table, "head": table.T.copy()}, ["ids"])
    assert step_weight_reads(untied, batch=2)["weights_bytes"] == 2 * 16 + 160  # two rows + the head


def test_int4_blocks_count_their_bytes_and_their_logical_elements() -> None:
    # A tied int4 embedding: MatMulNBits' [N, blocks, bytes] table (N 8, K 32, one block of 32 4-bit values = 16
    # bytes, fp32 scales), looked up through a Reshape by GatherBlockQuantized: read whole once.
    blocks, scales = np.zeros((8, 1, 16), np.uint8), np.ones((8, 1), np.float32)
    nodes = [helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=32, N=8, bits=4,
                              block_size=32),
             helper.make_node("Reshape", ["w", "shape"], ["view"]),
             helper.make_node("GatherBlockQuantized", ["view", "ids", "s"], ["e"], domain="com.microsoft", bits=4,
                              block_size=32)]
    data = _model(nodes, {"w": blocks, "s": scales, "shape": np.array([8, 16], np.int64)}, ["ids"])
    reads = step_weight_reads(data, batch=1)
    assert reads["weights_bytes"] == 8 * 16 + 8 * 4 + 2 * 8  # blocks, scales, the shape
    assert reads["weight_elements"] == 32 * 8 + 2  # K x N values (scales are no weights), the shape's 2


def test_moe_experts_count_the_k_routed_per_token() -> None:
    experts = np.zeros((8, 6, 4), np.float32)  # 8 experts of 96 bytes
    node = helper.make_node("MoE", ["x", "router", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=2)
    data = _model([node], {"fc1": experts, "fc2": experts.copy()})
    assert step_weight_reads(data, batch=1)["weights_bytes"] == 2 * (2 * 96)  # 2 of 8 experts, both stacks
    assert step_weight_reads(data, batch=8)["weights_bytes"] == 2 * (8 * 96)  # at most every expert


@pytest.mark.parametrize(("name", "gbps"), [
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H100 NVL", 3900), ("NVIDIA H200", 4800),
    ("NVIDIA A100-SXM4-80GB", 2039), ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA L40S", 864), ("NVIDIA L4", 300), ("NVIDIA A10G", 600), ("NVIDIA GeForce RTX 4090", 1008),
    ("NVIDIA GeForce RTX 5090", 1792), ("NVIDIA B200", 8000),
])
def test_gpu_bandwidth_by_the_name_nvidia_smi_reports(name: str, gbps: float) -> None:
    assert bandwidth.gpu_bandwidth_gbps(name)[0] == gbps


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA A100"])
def test_an_unknown_gpu_has_no_bandwidth_and_says_what_to_give(name: str) -> None:
    gbps, note = bandwidth.gpu_bandwidth_gbps(name)
    assert gbps is None and name in note and "give --mem-bandwidth GB/s" in note
    choice = bandwidth.gpu_bandwidth_choice(None, name)
    assert choice["mem_bandwidth_gbps"] is None and choice["mem_bandwidth_note"] == note
    assert bandwidth.gpu_bandwidth_choice(1234.0, name)["mem_bandwidth_source"] == "--mem-bandwidth"
    assert bandwidth.gpu_bandwidth_choice(None, "NVIDIA H200")["mem_bandwidth_source"] == "table: NVIDIA H200"


def test_share_and_mean_context_by_hand() -> None:
    # 3.35 GB per step in 1 ms is 3350 GB/s: the whole of an H100 SXM's bandwidth.
    assert bandwidth.share_pct(3.35e9, 1.0, 3350.0) == pytest.approx(100.0)
    assert bandwidth.share_pct(1e6, 1.0, None) is None
    # rows of 12 and 9 tokens, 6 new tokens: steps attend 13..17 and 10..14 positions, mean 13.5
    assert bandwidth.mean_context([12, 9], 6) == 13.5


@pytest.mark.parametrize("value", ["0", "abc", "-5", "nan", "inf"])
def test_mem_bandwidth_must_be_a_positive_number(value: str, exported) -> None:
    with pytest.raises(InputError, match="--mem-bandwidth takes the memory bandwidth in GB/s, a positive number"):
        bandwidth.parse_mem_bandwidth(value)
    folder = str(exported("llama-tiny", "ort"))
    for backend in ([], ["--backend", "ort-cuda"]):  # refused before either benchmark runs
        result = CliRunner().invoke(main, ["bench", folder, "--mem-bandwidth", value, *backend])
        assert result.exit_code == 2
        assert result.stderr.strip() == (f"kvforge: error: --mem-bandwidth takes the memory bandwidth in GB/s, a "
                                         f"positive number (e.g. 3350); got '{value}'")
