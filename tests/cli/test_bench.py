"""`kvforge bench` on a tiny export: the report's shape, the peers it can run here, its errors.
(Speeds are not asserted: the machine is shared; benchmarks/README.md has the figures.)"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from kvforge.cli import main  # noqa: E402
from kvforge.core.errors import BackendUnavailableError, KvforgeError  # noqa: E402
from kvforge.tools import bench, bench_workers  # noqa: E402


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CACHE", tmp_path / "bench-cache")
    return tmp_path / "bench-cache"


def test_bench_against_hf_reports_medians_spread_and_ratios(exported, cache) -> None:
    folder = exported("llama-tiny", "ort")
    report = bench.run_bench(folder, prompt_len=12, new_tokens=6, batch=2, repeat=2, threads=1, compare=("hf",),
                             cold_start=False)  # (timed in the CLI test, without torch's import per round)
    assert set(report["systems"]) == {"kvforge", "hf"}
    for name, row in report["systems"].items():
        assert len(report["raw"][name]) == 2  # one sample per round
        for metric in ("ttft_ms", "decode_tokens_per_s", "peak_rss_mb"):
            low, high = row[f"{metric}_spread"]
            assert low <= row[metric] <= high and row[metric] > 0
    hf = report["systems"]["hf"]
    ours = report["systems"]["kvforge"]
    assert hf["decode_ratio_kvforge_over_peer"] == pytest.approx(ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"])
    # Each round's share against the probe of that round: the median lies within the rounds' spread.
    assert report["mem_bandwidth_source"] == "measured" and report["mem_bandwidth_gbps"] > 0
    for row in report["systems"].values():
        low, high = row["decode_share_of_bandwidth_limit_pct_spread"]
        assert 0 < low <= row["decode_share_of_bandwidth_limit_pct"] <= high
    # Hugging Face runs the fp32 source: the same bytes per step as the fp32 export.
    assert hf["bytes_per_decode_step"] == ours["bytes_per_decode_step"] == report["bytes_per_decode_step"]["total_bytes"]
    assert ours["export_s"] > 0 and report["export_profile_s"]["trace"] > 0
    table = bench.format_table(report)
    assert "decode x" in table and "% of BW limit" in table and "measured by this machine's probe" in table


def test_bench_cli_json_and_errors(exported, cache, tmp_path) -> None:
    folder = str(exported("llama-tiny", "ort"))
    result = CliRunner().invoke(main, ["bench", folder, "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1",
                                       "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["systems"]["kvforge"]["decode_tokens_per_s"] > 0
    # Each worker's own peak: a tiny model's runtime stays far below the test process's size.
    assert report["systems"]["kvforge"]["peak_rss_mb"] < 400
    # The cold start: `kvforge generate` itself as a whole process (on ids when the export has no tokenizer).
    ours = report["systems"]["kvforge"]
    assert ours["cold_start_ms_spread"][0] <= ours["cold_start_ms"] == report["raw"]["kvforge"][0]["cold_start_ms"] > 0
    command = bench_workers.cold_start_command("kvforge", folder, report["cold_start_prompt"], 1)
    # --mem-bandwidth: the share is the step's bytes over its time over the given GB/s, and says where it came from.
    result = CliRunner().invoke(main, ["bench", folder, "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1",
                                       "--threads", "1", "--no-cold-start", "--mem-bandwidth", "20", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mem_bandwidth_source"] == "--mem-bandwidth" and report["mem_bandwidth_gbps"] == 20.0
    reads = report["bytes_per_decode_step"]
    # llama-tiny: K and V of 2 layers, 2 KV heads x 16, fp32, over 8 + 4 / 2 = 10 positions, one row
    assert reads["context_tokens"] == 10 and reads["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 10
    ours = report["systems"]["kvforge"]
    step_s = report["raw"]["kvforge"][0]["step_ms"] / 1e3
    assert ours["decode_share_of_bandwidth_limit_pct"] == pytest.approx(100 * reads["total_bytes"] / step_s / 20e9)
    assert command[1:5] == ["-m", "kvforge.cli", "generate", folder] and "--max-new-tokens" in command
    bad = CliRunner().invoke(main, ["bench", folder, "--compare", "vllm"])
    assert bad.exit_code == 2 and "--compare takes hf, ort-genai; got vllm" in bad.output
    bad = CliRunner().invoke(main, ["bench", folder, "--repeat", "0"])
    assert bad.exit_code == 2 and "--repeat must be >= 1, got 0" in bad.output
    with pytest.raises(KvforgeError, match="missing does not exist; pass the output folder of `kvforge export`"):
        bench.run_bench(tmp_path / "missing")
    # A prompt the export cannot hold is refused before any run (it failed in the worker).
    bad = CliRunner().invoke(main, ["bench", folder, "--prompt-len", "2047", "--new-tokens", "2"])
    assert bad.exit_code == 2 and "--prompt-len 2047 + --new-tokens 2 is over the export's 2048 positions" in bad.output


def test_bench_rows_keep_a_token_each_whatever_the_batch(exported, cache) -> None:
    # Row b had prompt_len - 3b tokens: --batch 8 --prompt-len 16 (and the default 128 at --batch 44) had an
    # empty row. The step shrinks instead; rows still differ in length where they can.
    assert bench_workers.row_lengths(128, 1) == [128] and bench_workers.row_lengths(128, 4) == [128, 125, 122, 119]
    assert bench_workers.row_lengths(16, 8) == [16, 14, 12, 10, 8, 6, 4, 2]
    assert min(bench_workers.row_lengths(128, 44)) >= 1 and min(bench_workers.row_lengths(4, 40)) == 4
    result = CliRunner().invoke(main, ["bench", str(exported("llama-tiny", "onnx")), "--batch", "8", "--prompt-len",
                                       "16", "--new-tokens", "3", "--repeat", "1", "--threads", "1", "--no-cold-start",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["systems"]["kvforge"]["decode_tokens_per_s"] > 0


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is not None, reason="onnxruntime-genai is installed")
def test_bench_without_onnxruntime_genai_says_how_to_get_it(exported, cache) -> None:
    with pytest.raises(BackendUnavailableError, match=r"pip install onnxruntime-genai"):
        bench.run_bench(exported("llama-tiny", "ort"), compare=("ort-genai",))


def test_bench_speculate_reports_acceptance_beside_plain(exported, cache) -> None:
    folder = str(exported("llama-tiny", "ort"))
    result = CliRunner().invoke(main, ["bench", folder, "--prompt-len", "12", "--new-tokens", "24", "--repeat", "1",
                                       "--threads", "1", "--speculate", "prompt-lookup", "--draft-len", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["speculate"] == "prompt-lookup"
    spec = report["systems"][bench.SPECULATIVE]
    assert spec["tokens_match_plain"] is True  # greedy output unchanged by speculation
    # The random tiny model rarely repeats itself, so few drafts and fewer acceptances; real text: benchmarks/.
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] and spec["draft_tokens"] > 0
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert spec["graph_runs"] <= 24  # one per generated token at most (plain decoding's count)
    for name in ("kvforge", bench.SPECULATIVE):
        assert report["systems"][name]["end_to_end_tokens_per_s"] > 0
    assert spec["decode_ratio_over_plain"] == pytest.approx(
        spec["decode_tokens_per_s"] / report["systems"]["kvforge"]["decode_tokens_per_s"])
    assert "drafted tokens accepted" in bench.format_table(report)
    bad = CliRunner().invoke(main, ["bench", folder, "--speculate", "prompt-lookup", "--draft-len", "99"])
    assert bad.exit_code == 2 and "--speculate: draft_len must be an integer in 1..15, got 99" in bad.output
    bad = CliRunner().invoke(main, ["bench", folder, "--speculate", "prompt-lookup", "--batch", "2"])
    assert bad.exit_code == 2 and "verifies drafts for 1 row(s) per call" in bad.output

def _profile_decode():
    spec = importlib.util.spec_from_file_location("profile_decode", "benchmarks/profile_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_decode_reads_the_last_runs_per_node_median_by_op_and_layer(tmp_path) -> None:
    """benchmarks/profile_decode.py's trace reader on a hand-made ONNX Runtime profile: a prefill run
    (ignored), then three decode runs of [Gather, norm, MatMul, norm, norm, MatMul]; one MatMul is
    stalled 50 ms in one run (a preempted thread), which the per-node median must not count."""
    nodes = [("emb", "Gather", 10), ("n0", "SimplifiedLayerNormalization", 20), ("mm0", "MatMul", 1000),
             ("n1", "SkipSimplifiedLayerNormalization", 30), ("n2", "SkipSimplifiedLayerNormalization", 40),
             ("mm1", "MatMul", 2000)]
    events, ts = [], 0
    for run in range(4):
        start = ts
        for name, op, dur in nodes:
            dur = 99_000 if run == 0 else dur + (50_000 if (run, name) == (2, "mm1") else 0)
            events.append({"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}})
            ts += dur + 1
        events.append({"cat": "Session", "name": "model_run", "ts": start, "dur": ts - start})
        ts += 100
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(events))
    profile = _profile_decode().decode_ops(str(trace), steps=3)
    assert profile["op_ms"] == pytest.approx({"Gather": 0.01, "SimplifiedLayerNormalization": 0.02, "MatMul": 3.0,
                                              "SkipSimplifiedLayerNormalization": 0.07})
    # Layer k owns norms 2k and 2k+1; before the first norm is the embedding.
    assert profile["layer_ms"] == pytest.approx({"embedding": 0.01, "0": 1.05, "1": 2.04})
    assert profile["op_count"] == {"Gather": 1, "SimplifiedLayerNormalization": 1, "MatMul": 2,
                                   "SkipSimplifiedLayerNormalization": 2}
    assert profile["run_ms"] == pytest.approx(3.106)  # the median run (3.1 ms of nodes, 1 us after each)
    assert profile["run_ms_min"] == pytest.approx(3.106)


def test_serving_peer_prompts_are_distinct_pieces_of_the_passage(tmp_path) -> None:
    """benchmarks/bench_serving_peer.py's prompts: `count` pieces of `words` consecutive words of the
    passage (wrapping around its end), each from another word, and its table's throughput ratio."""
    pytest.importorskip("openai")
    import sys

    sys.path.insert(0, "benchmarks")  # the script imports its neighbour bench_serve
    try:
        spec = importlib.util.spec_from_file_location("bench_serving_peer", "benchmarks/bench_serving_peer.py")
        peer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(peer)
    finally:
        sys.path.remove("benchmarks")
    passage = tmp_path / "passage.txt"
    passage.write_text(" ".join(f"w{i}" for i in range(10)))
    prompts = peer.text_prompts(4, 12, passage)
    assert prompts == ["w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w0 w1", "w2 w3 w4 w5 w6 w7 w8 w9 w0 w1 w2 w3",
                       "w4 w5 w6 w7 w8 w9 w0 w1 w2 w3 w4 w5", "w6 w7 w8 w9 w0 w1 w2 w3 w4 w5 w6 w7"]
    side = {"tokens_per_s": 50.0, "ttft_p50_ms": 40.2, "ttft_p99_ms": 90.7, "itl_median_ms": 20.04, "itl_p99_ms": 61.2,
            "load_avg_1m": [2.0, 2.5]}
    table = peer.table([{"clients": 4, "kvforge": {**side, "tokens_per_s": 60.0}, "llama.cpp": side}])
    assert "| 4 | kvforge | 60.0 | 40 / 91 | 20.0 / 61 | 2.0-2.5 |" in table
    assert "| 4 | kvforge / llama.cpp | x1.20 |" in table
    base = {"clients": 4, "requests": 8, "tokens": 512, "prompt_tokens": [53] * 8}
    samples = [{**base, **side, "load_avg_1m": [3.0, 3.5]}, {**base, **side, "tokens_per_s": 70.0, "load_avg_1m": [2.5, 2.7]},
               {**base, **side, "tokens_per_s": 10.0, "itl_p99_ms": 500.0, "load_avg_1m": [4.0, 4.1]}]
    combined = peer.combine(samples)
    assert combined["tokens_per_s"] == 50.0 and combined["itl_p99_ms"] == 61.2 and combined["load_avg_1m"] == [2.5, 4.1]
    assert combined["all_same_lengths"] and combined["samples"] == samples and combined["prompt_tokens"] == [53] * 24
    assert not peer.combine([samples[0], {**samples[1], "tokens": 500}])["all_same_lengths"]


def test_the_system_table_keeps_its_columns_whatever_the_names() -> None:
    # A long system name shifted every column after it (issue 43, 22).
    def row(tps: float, **extra) -> dict:
        return {"ttft_ms": 181.0, "decode_tokens_per_s": tps, "decode_tokens_per_s_spread": (tps - 1, tps + 1),
                "peak_rss_mb": 694.0, **extra}

    peer = next(iter(bench.PEERS))
    ratios = {"decode_ratio_kvforge_over_peer": 1.12, "ttft_ratio_kvforge_over_peer": 0.82,
              "rss_ratio_kvforge_over_peer": 0.89}
    lines = bench._system_rows({"kvforge": row(50.4, precision="fp32"),
                                peer: row(1234.5, precision="int4-a-long-precision-name", **ratios)})
    header, ours, theirs = lines
    for column in ("TTFT ms", "decode tok/s (min-max)", "peak RSS MB", "decode x", "RSS x"):
        end = header.index(column) + len(column)  # right-aligned numbers end where their header ends
        assert theirs[end - 1] != " " and (end == len(theirs) or theirs[end] == " "), (column, theirs)
    assert ours.index("50.4") + len("50.4 (49-51)") == header.index("decode tok/s (min-max)") + len("decode tok/s (min-max)")
    assert theirs.endswith("1.12    0.82   0.89")


def test_bench_speculate_with_a_draft_export(exported, draft_export, cache, tmp_path) -> None:
    folder = str(exported("llama-tiny", "ort"))
    text = tmp_path / "prompt.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    report = bench.run_bench(folder, prompt_len=12, new_tokens=16, repeat=1, threads=1, speculate="draft",
                             draft_len=3, draft=draft_export("ort"), cold_start=False, prompt_file=text)
    spec = report["systems"][bench.SPECULATIVE]
    assert spec["method"] == "draft" and spec["tokens_match_plain"] is True
    assert len(spec["acceptance_by_position"]) == 3 and all(0 <= rate <= 1 for rate in spec["acceptance_by_position"])
    # A kept draft position was reached and kept at every earlier one: acceptance falls with the position.
    assert spec["acceptance_by_position"] == sorted(spec["acceptance_by_position"], reverse=True)
    assert spec["tokens_per_target_step"] > 1.0
    assert "tokens per target step" in bench.format_table(report)
    bad = CliRunner().invoke(main, ["bench", folder, "--draft", str(draft_export("ort"))])
    assert bad.exit_code == 2 and "--draft is the draft export of --speculate draft" in bad.output
    bad = CliRunner().invoke(main, ["bench", folder, "--speculate", "draft"])
    assert bad.exit_code == 2 and "--speculate draft needs --draft DIR" in bad.output
    short = tmp_path / "short.txt"
    short.write_text("two words")
    bad = CliRunner().invoke(main, ["bench", folder, "--prompt-file", str(short), "--prompt-len", "12"])
    assert bad.exit_code == 2 and "fewer than --prompt-len 12" in bad.output
