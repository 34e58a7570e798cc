"""`kvforge bench --backend ort-cuda` (kvforge/tools/bench_gpu.py), the parts that run without a GPU: its checks,
the kvforge worker (driven here on ort-cpu), a peer that fails beside the others, and the table.
The figures themselves come from a GPU (benchmarks/results/bench_smollm2_fp16_h100.*), never from tests."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import InputError
from kvforge.runtime import Generator
from kvforge.tools import bench_gpu


def test_bad_options_are_refused_before_any_run(exported) -> None:
    folder = exported("llama-tiny")
    with pytest.raises(InputError, match="takes hf, hf-compiled; got ort-genai"):
        bench_gpu.run_gpu_bench(folder, "ort-cuda", compare=("ort-genai",))
    with pytest.raises(InputError, match="runs backend ort-cuda, tensorrt"):
        bench_gpu.run_gpu_bench(folder, "ort-cpu")
    capacity = json.loads((folder / "kvforge.json").read_text())["kv_cache"]["max_capacity"]
    with pytest.raises(InputError, match=rf"--prompt-len {capacity} \+ --new-tokens 2 is over the export's {capacity} "):
        bench_gpu.run_gpu_bench(folder, "ort-cuda", prompt_len=capacity, new_tokens=2)
    runner = CliRunner()
    result = runner.invoke(main, ["bench", str(folder), "--batch", "1,8"])
    assert result.exit_code == 2 and "several --batch sizes are for the GPU benchmark" in result.output
    result = runner.invoke(main, ["bench", str(folder), "--batch", "one"])
    assert result.exit_code == 2 and "--batch takes a size or a comma-separated list" in result.output
    result = runner.invoke(main, ["bench", str(folder), "--backend", "emulate"])
    assert result.exit_code == 2 and "not emulate" in result.output


def test_the_kvforge_worker_times_each_batch_and_returns_its_greedy_tokens(exported) -> None:
    folder = exported("llama-tiny")
    out = bench_gpu._work_kvforge(str(folder), 20, 6, [1, 3], 2, "ort-cpu", {})
    assert set(out["batches"]) == {"1", "3"}
    for batch, row in out["batches"].items():
        assert row["decode_tokens_per_s"] > 0 and row["ttft_ms"] > 0
        assert row["ttft_ms_spread"][0] <= row["ttft_ms"] <= row["ttft_ms_spread"][1]
        assert len(out["tokens"][batch]) == int(batch)
    gen = Generator(folder)
    rows = bench_gpu.prompt_rows(20, 3, gen.vocab_size)
    assert out["tokens"]["3"] == gen.generate(rows, max_new_tokens=6, greedy=True, ignore_eos=True).tokens


def test_a_failing_peer_is_reported_beside_the_others(exported, monkeypatch) -> None:
    folder = exported("llama-tiny")
    calls = []

    class Done:
        def __init__(self, stdout: str, returncode: int = 0, stderr: str = "") -> None:
            self.stdout, self.returncode, self.stderr = stdout, returncode, stderr

    def fake_run(command, capture_output, text, timeout):
        system = command[4]
        calls.append((system, timeout))
        if system == "hf-compiled":
            return Done("", 1, "Traceback ...\nRuntimeError: compilation failed")
        row = {"ttft_ms": 4.0 if system == "kvforge" else 20.0, "decode_tokens_per_s": 800.0 if system == "kvforge"
               else 50.0, "step_ms": 1.0}
        return Done(json.dumps({"batches": {"1": {**row, **{f"{k}_spread": [v, v] for k, v in row.items()}}},
                                "tokens": {"1": [[1, 2]]}, "gpu_memory_mb": 600.0}))

    monkeypatch.setattr(bench_gpu.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_gpu, "_gpu_name", lambda: "Stand-in GPU")
    report = bench_gpu.run_gpu_bench(folder, "ort-cuda", (1,), compare=("hf", "hf-compiled"), worker_timeout=30)
    assert [c[0] for c in calls] == ["kvforge", "hf", "hf-compiled"] and calls[0][1] == 30
    assert report["systems"]["hf-compiled"]["error"] == "RuntimeError: compilation failed"
    hf = report["systems"]["hf"]["batches"]["1"]
    assert hf["decode_ratio_kvforge_over_peer"] == 16.0 and hf["ttft_ratio_kvforge_over_peer"] == 0.2
    assert hf["tokens_equal_kvforge"]
    table = bench_gpu.format_gpu_table(report)
    assert "Stand-in GPU" in table and "hf-compiled   failed: RuntimeError: compilation failed" in table
    assert "decode x16.00, TTFT x0.20" in table
    # A GPU the bandwidth table does not know: no share, and the table says what to give.
    assert report["mem_bandwidth_gbps"] is None and report["systems"]["kvforge"]["batches"]["1"][
        "decode_share_of_bandwidth_limit_pct"] is None
    assert "% of BW limit: not computed, no bandwidth figure for GPU 'Stand-in GPU'" in table
    # A known one: the step's bytes (1 ms a step in the stand-in rows) over its datasheet bandwidth.
    monkeypatch.setattr(bench_gpu, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    report = bench_gpu.run_gpu_bench(folder, "ort-cuda", (1,), compare=("hf",))
    assert report["mem_bandwidth_gbps"] == 3350 and report["mem_bandwidth_source"] == "table: NVIDIA H100 80GB HBM3"
    ours, hf = (report["systems"][name]["batches"]["1"] for name in ("kvforge", "hf"))
    # batch 1, 128-token prompt, 128 new: 192 positions of K and V, 2 layers x 2 KV heads x 16, fp32
    assert report["bytes_per_decode_step"]["1"]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 192
    assert ours["decode_share_of_bandwidth_limit_pct"] == pytest.approx(100 * ours["bytes_per_decode_step"] / 1e-3 / 3350e9)
    assert hf["bytes_per_decode_step"] == ours["bytes_per_decode_step"]  # Hugging Face in the export's fp32
    assert "3350 GB/s (table: NVIDIA H100 80GB HBM3)" in bench_gpu.format_gpu_table(report)
