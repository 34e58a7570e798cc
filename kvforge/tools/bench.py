"""`kvforge bench`: time to first token, decode tokens/s (and its share of the bandwidth limit), peak memory,
against peers.

Every system runs in its own process (so peak RSS is its own), after a warm-up generation, and the
systems take turns round by round so that machine noise hits all alike; the table reports medians and
the spread over rounds, and each peer's ratio to kvforge. Peers: Hugging Face eager on the export's
source folder, and onnxruntime-genai with a model its builder makes from that folder (fp32, or int4 when
the export is int4-quantised), cached under ~/.cache/kvforge/bench.

Cold start: a whole process per system and round, from its spawn to its exit after printing one
generated token (interpreter, imports, manifest checks, tokenizer, session creation, first prefill), as
a CLI user pays it on every call: for kvforge its own `kvforge generate OUT --prompt TEXT
--max-new-tokens 1`, for onnxruntime-genai the few calls of its Python API that do the same (model,
tokenizer, one token), for Hugging Face from_pretrained and generate. Alternated like the rest.

Decode tokens/s excludes the prefill. Beside each system's figure, its share of the memory-bandwidth limit:
the bytes it reads per decode step (weights and KV cache, kvforge/tools/bandwidth.py) over the step's time,
against this machine's bandwidth as a short ONNX Runtime MatMul probe measures it in every round (or as
`mem_bandwidth` gives it).

The workers and the cold-start processes: kvforge/tools/bench_workers.py.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import BackendUnavailableError, InputError
from kvforge.core.manifest import load_manifest
from kvforge.tools.bandwidth import (
    bandwidth_probe,
    bytes_per_decode_step,
    genai_decoder_graph,
    mean_context,
    parse_mem_bandwidth,
    share_pct,
)
from kvforge.tools.bench_workers import (
    COLD_PROMPT,
    PROMPT_IDS_ENV,
    SPECULATIVE,
    check_fits,
    cold_start_ms,
    prompt_ids,
    row_lengths,
)

PEERS = ("hf", "ort-genai")
CACHE = Path(os.environ.get("KVFORGE_BENCH_CACHE") or Path.home() / ".cache" / "kvforge" / "bench")


# -- the orchestrator -------------------------------------------------------------------------------
def _genai_model(source: Path, precision: str, say: Callable[[str], None]) -> Path:
    import hashlib
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise BackendUnavailableError(
            "--compare ort-genai needs onnxruntime-genai: pip install onnxruntime-genai (or pip install -e '.[bench]')"
        )
    key = hashlib.sha256(f"{source.resolve()}:{precision}".encode()).hexdigest()[:16]
    out = CACHE / f"genai-{key}-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    say(f"building onnxruntime-genai's {precision} model from {source} (its model builder)")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out),
                           "-p", precision, "-e", "cpu"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InputError(f"onnxruntime-genai's builder failed on {source}: {proc.stderr.strip().splitlines()[-1:]}")
    (out / "kvforge_build_seconds").write_text(f"{time.perf_counter() - started:.2f}")
    return out


def run_bench(export_dir: str | Path, prompt_len: int = 128, new_tokens: int = 128, batch: int = 1,
              repeat: int = 3, threads: int = 2, compare: tuple[str, ...] = (),
              say: Callable[[str], None] | None = None, speculate: str | None = None,
              draft_len: int = 6, cold_start: bool = True, spinning: bool = True,
              mem_bandwidth: float | None = None, draft: str | Path | None = None,
              prompt_file: str | Path | None = None) -> dict[str, Any]:
    """The report (see the module docstring). `speculate` (a method of runtime/controls/speculate.py; `draft`:
    the draft export of method "draft") adds kvforge with speculation (row SPECULATIVE) beside plain kvforge:
    its acceptance per draft position, tokens per target step and ratios; `prompt_file`: a UTF-8 text whose
    tokens (the export's tokenizer) are every system's prompt, instead of ids in a progression;
    `cold_start=False` skips the cold-start processes;
    `spinning=False`: kvforge's ONNX Runtime threads sleep instead of spinning while they wait (the
    peers keep their defaults); `mem_bandwidth` (GB/s): the bandwidth the shares are taken of, instead of
    the probe's measurement."""
    say = say or (lambda _msg: None)
    mem_bandwidth = parse_mem_bandwidth(mem_bandwidth)
    export_dir = Path(export_dir)
    manifest = _checked(export_dir, prompt_len, new_tokens, batch, repeat, threads, compare, speculate, draft_len)
    _check_draft(export_dir, speculate, draft)
    if prompt_file is not None:
        os.environ[PROMPT_IDS_ENV] = str(_prompt_ids_file(export_dir, Path(prompt_file), prompt_len))
    source = Path(manifest["model"].get("source", ""))
    quant = manifest.get("quantization") or {}
    systems: dict[str, str] = {"kvforge": str(export_dir)}
    if speculate is not None:
        systems[SPECULATIVE] = str(export_dir)
    if "hf" in compare:
        if not (source / "config.json").is_file():
            raise InputError(f"--compare hf needs the export's source folder {source}, which is gone")
        systems["hf"] = str(source)
    if "ort-genai" in compare:
        # The builder's CPU precisions are fp32 and int4: an int8 export is compared with its fp32.
        peer_precision = "int4" if quant.get("bits") == 4 else "fp32"
        systems["ort-genai"] = str(_genai_model(source, peer_precision, say))
    # Cold start is timed on a text prompt when the export has a tokenizer (a CLI user's call), else on ids.
    cold_prompt = COLD_PROMPT if (export_dir / "tokenizer.json").is_file() else ",".join(
        map(str, prompt_ids(8, 0, int(manifest["model"]["vocab_size"]))))
    worker = [str(prompt_len), str(new_tokens), str(batch), str(threads), "1" if spinning else "0"]
    probe = bandwidth_probe(threads) if mem_bandwidth is None else None  # a given bandwidth needs no probe
    spec_args = [str(draft_len), speculate or "-", str(draft) if draft is not None else "-"]
    try:
        runs, probes = _rounds(systems, worker, repeat, threads, spec_args, cold_prompt if cold_start else None, say,
                               probe)
    finally:
        os.environ.pop(PROMPT_IDS_ENV, None)
    # Speculation keeps greedy output: its tokens must be plain kvforge's, round by round.
    tokens = {name: [sample.pop("tokens", None) for sample in samples] for name, samples in runs.items()}
    table = {name: _medians(samples) for name, samples in runs.items()}
    ours = table["kvforge"]
    bandwidths = probes if mem_bandwidth is None else [mem_bandwidth] * repeat
    # Each system's rows read the KV over the mean context of its decode (row b's prompt: prompt_len - 3b).
    context = mean_context(row_lengths(prompt_len, batch), new_tokens)
    reads = _decode_shares(table, runs, systems, manifest, export_dir, batch, context, bandwidths)
    if SPECULATIVE in table:
        _speculation_row(table, runs, tokens, draft_len, speculate, draft)
    _ratios(table, cold_start)
    # Export / build time: kvforge's from its manifest, the peer builder's as timed when it ran.
    ours["export_s"] = (manifest.get("export_seconds") or {}).get("total")
    if "ort-genai" in systems:
        timing = Path(systems["ort-genai"]) / "kvforge_build_seconds"
        table["ort-genai"]["export_s"] = float(timing.read_text()) if timing.is_file() else None
        table["ort-genai"]["precision"] = peer_precision
        if ours["export_s"] and table["ort-genai"]["export_s"]:
            table["ort-genai"]["export_ratio_kvforge_over_peer"] = ours["export_s"] / table["ort-genai"]["export_s"]
    return {"export": str(export_dir), "prompt_len": prompt_len, "new_tokens": new_tokens, "batch": batch,
            "repeat": repeat, "threads": threads, "spinning": spinning, "bytes_per_decode_step": reads,
            "speculate": speculate, "cold_start_prompt": cold_prompt if cold_start else None,
            "mem_bandwidth_gbps": statistics.median(bandwidths),
            "mem_bandwidth_gbps_spread": [min(bandwidths), max(bandwidths)],
            "mem_bandwidth_source": "measured" if probes else "--mem-bandwidth",
            "export_profile_s": manifest.get("export_seconds"),
            "systems": table, "raw": runs}


def _checked(export_dir: Path, prompt_len: int, new_tokens: int, batch: int, repeat: int, threads: int,
             compare: tuple[str, ...], speculate: str | None, draft_len: int) -> dict[str, Any]:
    """The export's manifest, once the options are checked against it (InputError names a bad one)."""
    from kvforge.core.targets import get_target
    from kvforge.runtime.controls.speculate import check_speculation

    for name, value, low in (("--prompt-len", prompt_len, 4), ("--new-tokens", new_tokens, 2), ("--batch", batch, 1),
                             ("--repeat", repeat, 1), ("--threads", threads, 1)):
        if value < low:
            raise InputError(f"{name} must be >= {low}, got {value}")
    unknown = sorted(set(compare) - set(PEERS))
    if unknown:
        raise InputError(f"--compare takes {', '.join(PEERS)}; got {', '.join(unknown)}")
    manifest = load_manifest(export_dir)
    check_fits(manifest, prompt_len, new_tokens)
    if speculate is not None:
        try:
            check_speculation(speculate, draft_len)
        except ValueError as err:
            raise InputError(f"--speculate: {err}") from err
        rows_at_once = get_target(manifest["target"]).continue_batch
        if rows_at_once is not None and batch > rows_at_once:
            raise InputError(f"--speculate with --batch {batch}: the {manifest['target']!r} target verifies drafts "
                             f"for {rows_at_once} row(s) per call; use --batch 1 or an export with --target onnx")
    return manifest


def _check_draft(export_dir: Path, speculate: str | None, draft: str | Path | None) -> None:
    """A draft export goes with --speculate draft only, and must draft for this export (checked by loading both)."""
    if draft is not None and speculate != "draft":
        raise InputError("--draft is the draft export of --speculate draft; add --speculate draft or drop --draft")
    if speculate == "draft":
        if draft is None:
            raise InputError("--speculate draft needs --draft DIR: an export with this export's vocabulary (e.g. its "
                             "int4 export)")
        from kvforge.runtime.drivers.draft_model import DraftModel
        from kvforge.runtime.drivers.loaded_export import LoadedExport

        DraftModel.open(draft, LoadedExport(export_dir))


def _prompt_ids_file(export_dir: Path, text_file: Path, prompt_len: int) -> Path:
    """The --prompt-file text's token ids, written where the workers read them; InputError when it is shorter
    than --prompt-len tokens."""
    from kvforge.runtime.text.tokenizer import Tokenizer

    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"--prompt-file {text_file}: {err}") from None
    ids = Tokenizer(export_dir).encode(text)
    if len(ids) < prompt_len:
        raise InputError(f"--prompt-file {text_file} has {len(ids)} tokens, fewer than --prompt-len {prompt_len}")
    out = CACHE / "prompts" / f"{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ids[:prompt_len]))
    return out


def _decode_shares(table: dict[str, Any], runs: dict[str, list[dict[str, Any]]], systems: dict[str, str],
                   manifest: dict[str, Any], export_dir: Path, batch: int, context: float,
                   bandwidths: list[float]) -> dict[str, Any]:
    """Each system's bytes read per decode step and its share of the bandwidth limit: each round's step time
    against that round's bandwidth, the median and spread over rounds. Returns kvforge's bytes per step."""
    reads = bytes_per_decode_step(manifest, export_dir, batch, context)
    for name, row in table.items():
        if name == "hf":  # the source model in fp32 (bench_workers): the same weights, 4 bytes each
            step_bytes = bytes_per_decode_step(manifest, export_dir, batch, context, dtype="fp32")["total_bytes"]
        elif name == "ort-genai":  # its own graph's weights (its int4 blocks are not kvforge's); an fp32 cache
            step_bytes = bytes_per_decode_step(manifest, export_dir, batch, context, dtype="fp32",
                                               graph=genai_decoder_graph(systems[name]))["total_bytes"]
        else:  # kvforge, with or without speculation (a verification call reads what a step reads)
            step_bytes = reads["total_bytes"]
        shares = [share_pct(step_bytes, sample["step_ms"], gbps) or 0.0
                  for sample, gbps in zip(runs[name], bandwidths, strict=True)]
        row["bytes_per_decode_step"] = step_bytes
        row["decode_read_gbps"] = step_bytes / (row["step_ms"] / 1e3) / 1e9
        row["decode_share_of_bandwidth_limit_pct"] = statistics.median(shares)
        row["decode_share_of_bandwidth_limit_pct_spread"] = [min(shares), max(shares)]
    return reads


def _rounds(systems: dict[str, str], worker: list[str], repeat: int, threads: int, spec_args: list[str],
            cold_prompt: str | None, say: Callable[[str], None],
            probe: Callable[[], float] | None) -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """Each system's worker process once a round, systems taking turns, then (with `cold_prompt`) their
    cold starts; the bandwidth `probe` (if any) once a round beside them. Each system's samples, and the probes."""
    probes: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for round_ in range(repeat):
        if probe is not None:
            probes.append(probe())
        for name, path in systems.items():  # take turns, round by round
            say(f"timing {name}, round {round_ + 1}/{repeat}")
            extra = spec_args if name == SPECULATIVE else []
            proc = subprocess.run([sys.executable, "-m", "kvforge.tools.bench_workers", "worker", name, path, *worker,
                                   *extra], capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise InputError(f"the {name} benchmark process failed: {tail}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        for name, path in systems.items() if cold_prompt is not None else ():  # cold starts take turns too
            if name == SPECULATIVE:  # the same process start as plain kvforge's
                continue
            say(f"timing the cold start of {name}, round {round_ + 1}/{repeat}")
            runs[name][-1]["cold_start_ms"] = cold_start_ms(name, path, cold_prompt, threads)
    return runs, probes


def _medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for metric in ("ttft_ms", "decode_tokens_per_s", "peak_rss_mb", "step_ms", "end_to_end_tokens_per_s",
                   "cold_start_ms"):
        if metric not in samples[0]:  # end to end: kvforge's rows only; cold start: not the lookup row
            continue
        values = [s[metric] for s in samples]
        row[metric] = statistics.median(values)
        row[f"{metric}_spread"] = [min(values), max(values)]
    return row


def _speculation_row(table: dict[str, Any], runs: dict[str, Any], tokens: dict[str, Any], draft_len: int,
                     method: str, draft: str | Path | None) -> None:
    ours, spec, last = table["kvforge"], table[SPECULATIVE], runs[SPECULATIVE][-1]
    spec.update(method=method, draft=str(draft) if draft is not None else None, draft_len=draft_len,
                draft_tokens=last["draft_tokens"], accepted_tokens=last["accepted_tokens"],
                graph_runs=last["steps"] + 1, tokens_match_plain=tokens[SPECULATIVE] == tokens["kvforge"],
                tokens_per_target_step=last["tokens_per_step"],
                acceptance_by_position=[kept / reached if reached else 0.0
                                        for kept, reached in zip(last["accepted_at"], last["drafted_at"], strict=True)])
    spec["acceptance_rate"] = last["accepted_tokens"] / last["draft_tokens"] if last["draft_tokens"] else 0.0
    spec["decode_ratio_over_plain"] = spec["decode_tokens_per_s"] / ours["decode_tokens_per_s"]
    spec["end_to_end_ratio_over_plain"] = spec["end_to_end_tokens_per_s"] / ours["end_to_end_tokens_per_s"]


def _ratios(table: dict[str, Any], cold_start: bool) -> None:
    """Each peer's row gets kvforge's ratios over it (and the speculative row's, when there is one)."""
    ours = table["kvforge"]
    for name, row in table.items():
        if name not in PEERS:
            continue
        if SPECULATIVE in table:
            row["decode_ratio_speculative_over_peer"] = table[SPECULATIVE]["decode_tokens_per_s"] / row["decode_tokens_per_s"]
        row["decode_ratio_kvforge_over_peer"] = ours["decode_tokens_per_s"] / row["decode_tokens_per_s"]
        row["ttft_ratio_kvforge_over_peer"] = ours["ttft_ms"] / row["ttft_ms"]
        row["rss_ratio_kvforge_over_peer"] = ours["peak_rss_mb"] / row["peak_rss_mb"]
        if cold_start:
            row["cold_start_ratio_kvforge_over_peer"] = ours["cold_start_ms"] / row["cold_start_ms"]


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{report['export']}: prompt {report['prompt_len']}, {report['new_tokens']} new tokens, batch "
             f"{report['batch']}, {report['threads']} threads"
             f"{'' if report.get('spinning', True) else ' (kvforge: --no-spin)'}, median of {report['repeat']} rounds"]
    lines += _system_rows(report["systems"])
    lines.append("ratios: kvforge / that system. decode above 1 = kvforge faster; TTFT and RSS below 1 = kvforge "
                 "sooner and smaller")
    ours = report["systems"]["kvforge"]
    spec = report["systems"].get(SPECULATIVE)
    if spec is not None:
        same = "same tokens as plain decoding" if spec["tokens_match_plain"] else "TOKENS DIFFER FROM PLAIN DECODING"
        by_position = " ".join(f"{100 * rate:.0f}%" for rate in spec["acceptance_by_position"])
        lines.append(f"{SPECULATIVE} ({spec['method']}, draft_len {spec['draft_len']}): {spec['accepted_tokens']}/"
                     f"{spec['draft_tokens']} drafted tokens accepted ({100 * spec['acceptance_rate']:.0f}%; by position "
                     f"{by_position}), {spec['tokens_per_target_step']:.2f} tokens per target step, "
                     f"{spec['graph_runs']} graph runs; decode {ours['decode_tokens_per_s']:.1f} -> "
                     f"{spec['decode_tokens_per_s']:.1f} tok/s (x{spec['decode_ratio_over_plain']:.2f}), end to end "
                     f"{ours['end_to_end_tokens_per_s']:.1f} -> {spec['end_to_end_tokens_per_s']:.1f} tok/s "
                     f"(x{spec['end_to_end_ratio_over_plain']:.2f}); {same}")
        for name, row in report["systems"].items():
            if "decode_ratio_speculative_over_peer" in row:
                lines.append(f"{SPECULATIVE} decode over {name}: x{row['decode_ratio_speculative_over_peer']:.2f}")
    if "cold_start_ms" in ours:
        lines.append("cold start (whole process, start to first token), ms: " + "; ".join(
            f"{name} {row['cold_start_ms']:.0f} ({row['cold_start_ms_spread'][0]:.0f}-{row['cold_start_ms_spread'][1]:.0f})"
            + (f", kvforge x{row['cold_start_ratio_kvforge_over_peer']:.2f}" if name != "kvforge" else "")
            for name, row in report["systems"].items() if "cold_start_ms" in row))
    for name, row in report["systems"].items():
        if row.get("export_s"):
            ratio = row.get("export_ratio_kvforge_over_peer")
            lines.append(f"{name} export/build: {row['export_s']:.1f} s" + (f" (kvforge x{ratio:.2f})" if ratio else ""))
    lines += _bandwidth_lines(report)
    return "\n".join(lines)


def _system_rows(systems: dict[str, Any]) -> list[str]:
    """The per-system table, its columns as wide as their widest cell (a long system name or a wide decode
    figure shifted every column after it)."""
    header = ["system", "TTFT ms", "decode tok/s (min-max)", "% of BW limit", "peak RSS MB", "decode x", "TTFT x",
              "RSS x"]
    rows = []
    for name, row in systems.items():
        lo, hi = row["decode_tokens_per_s_spread"]
        share = row.get("decode_share_of_bandwidth_limit_pct")
        ratios = ["", "", ""]
        if name in PEERS:
            ratios = [f"{row[f'{key}_ratio_kvforge_over_peer']:.2f}" for key in ("decode", "ttft", "rss")]
        elif name == SPECULATIVE:
            ratios = [f"{row['decode_ratio_over_plain']:.2f} (over plain kvforge)", "", ""]
        rows.append([f"{name} {row['precision']}" if row.get("precision") else name, f"{row['ttft_ms']:.1f}",
                     f"{row['decode_tokens_per_s']:.1f} ({lo:.0f}-{hi:.0f})", "-" if share is None else f"{share:.1f}%",
                     f"{row['peak_rss_mb']:.0f}", *ratios])
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(cells, widths, strict=True))).rstrip()
            for cells in [header, *rows]]


def _bandwidth_lines(report: dict[str, Any]) -> list[str]:
    """What the "% of BW limit" column divides: the bytes each system reads per step, and the bandwidth."""
    reads = report.get("bytes_per_decode_step")
    if not reads:
        return []
    states = f" + {reads['state_bytes'] / 1e6:,.2f} MB of recurrent state" if reads["state_bytes"] else ""
    peers = "".join(f"; {name} {row['bytes_per_decode_step'] / 1e6:,.2f} MB" for name, row in report["systems"].items()
                    if name in PEERS)
    low, high = report["mem_bandwidth_gbps_spread"]
    where = (f"measured by this machine's probe in each round ({low:.1f}-{high:.1f} GB/s)"
             if report["mem_bandwidth_source"] == "measured" else f"from {report['mem_bandwidth_source']}")
    return [f"% of BW limit = bytes read per decode step / step time / bandwidth. Per step kvforge reads "
            f"{reads['weights_bytes'] / 1e6:,.2f} MB of weights + {reads['kv_bytes'] / 1e6:,.2f} MB of KV cache{states} "
            f"(batch {reads['batch']}, {reads['context_tokens']:.0f} tokens of context per row, the decode's mean){peers}",
            f"bandwidth {report['mem_bandwidth_gbps']:.1f} GB/s, {where}"]


def check_plot(path: str | Path) -> None:
    """Fail before any measuring if `--plot PATH` could not be drawn or written."""
    import importlib.util

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise InputError(f"--plot writes a PNG; give a path ending in .png, got {path}")
    if not path.parent.resolve().is_dir():
        raise InputError(f"--plot {path}: the folder {path.parent} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise BackendUnavailableError("--plot needs matplotlib: pip install -e '.[bench]'")


def plot(report: dict[str, Any], path: str | Path) -> None:
    check_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["systems"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    metrics = (("decode_tokens_per_s", "decode tokens/s (higher is better)", "{:.1f}"),
               ("ttft_ms", "time to first token, ms (lower is better)", "{:.1f}"),
               ("peak_rss_mb", "peak RSS, MB (lower is better)", "{:.0f}"))
    for ax, (metric, label, fmt) in zip(axes, metrics, strict=True):
        values = [report["systems"][n][metric] for n in names]
        spreads = [report["systems"][n][f"{metric}_spread"] for n in names]
        errors = [[v - s[0] for v, s in zip(values, spreads, strict=True)], [s[1] - v for v, s in zip(values, spreads, strict=True)]]
        bars = ax.bar(names, values, yerr=errors, capsize=4, color=["#2f6db5"] + ["#999999"] * (len(names) - 1))
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], label_type="center", color="white")
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"{Path(report['export']).name}: prompt {report['prompt_len']}, {report['new_tokens']} new, "
                 f"batch {report['batch']}, {report['threads']} threads; bars: median, whiskers: min-max of "
                 f"{report['repeat']} rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
