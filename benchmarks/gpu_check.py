"""The one GPU script: ONNX Runtime CUDA (`--backend ort-cuda`) checked and timed in one short window.

    python benchmarks/gpu_check.py --prepare-only --work .gpu/work     # here, on the CPU: HF folders + exports
    python benchmarks/gpu_check.py --work .gpu/work --out $OUT         # on the GPU machine

Sections, in order of importance, each timed and caught (a failure is recorded, the next one runs), every
result appended to OUT/gpu_check.json as it lands, a log in OUT/gpu_check.log, a summary printed last:

  env         nvidia-smi and `kvforge doctor`
  decode      llama-tiny fp16 greedy tokens vs Hugging Face: CUDA graphs on, off, and sessions=single;
              in-place KV addresses; Memcpy nodes in ONNX Runtime's optimised prefill and decode graphs
  families    `kvforge parity --backend ort-cuda` for every hand-written family's tiny recipe (fp16), and the
              same tokens with and without CUDA graphs
  bf16        llama-tiny bf16 parity
  onnx        the `onnx` target (opset-24 Attention + TensorScatter) on ort-cuda: parity, or why not
  batch       a batch of prompts of different lengths = each prompt alone; prompt-lookup speculation = greedy
  speculation a draft export (llama-tiny's int4) and an EAGLE-3 head (random, 4-layer llama-tiny): greedy tokens
              = plain greedy on the GPU backend, the head's logits against the same graph on the CPU
              (benchmarks/gpu_speculation.py)
  serving     the Scheduler on ort-cuda (chunked prefill, rows moving, a second turn from the prefix store)
              = each request alone; `kvforge serve --backend ort-cuda` over HTTP = the Generator
  new_kinds   issue 35's cache kinds on the GPU, tiny sweep configs in fp16: per-layer KV shapes (gemma4_text),
              latent attention (deepseek_v3; deepseek_v32 with its sparse-attention indexer adapted, capped at
              index_topk), recurrent state (bamba: Mamba 2 + attention; mamba; rwkv: a state outside transformers'
              cache), ALiBi (bloom: GroupQueryAttention's attention_bias on CUDA): parity, a
              batch of different lengths = each alone, and the Scheduler (device row copies of states) = solo
  step_profile  benchmarks/gpu_step_profile.py on the SmolLM2-135M-shape fp16 export: replay vs host work, kernels
  bench       SmolLM2-135M shape fp16: `kvforge bench --backend ort-cuda --compare hf,hf-compiled --batch 1,8`,
              and kvforge without CUDA graphs and with greedy picks on the host

Sections whose GPU stack is missing record why and skip. `--backend ort-cpu` runs the same checks on the
CPU (without the CUDA-graph variants and the GPU benchmark): how the script itself is tested before a
GPU window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BACKEND = "ort-cuda"  # --backend
PEERS: tuple[str, ...] = ("hf", "hf-compiled")  # --peers
PROMPTS = [[1, 50, 60, 70, 80, 90, 100, 7], [1, 33, 44], [1, 5, 9, 200, 300, 11, 12, 13, 14, 15, 16, 17, 18]]


class Run:
    def __init__(self, out: Path, work: Path, budget: float) -> None:
        self.out, self.work, self.budget = out, work, budget
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {}
        self.background: dict[str, subprocess.Popen] = {}  # export folder name -> its export process
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu_check.log", "a")  # noqa: SIM115 (open for the whole run)

    def log(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.started:7.1f}s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def section(self, name: str, fn: Callable[[Run], Any]) -> None:
        left = self.budget - (time.perf_counter() - self.started)
        if left < 20:
            self.results[name] = {"skipped": f"time budget spent ({left:.0f} s left)"}
            self.log(f"{name}: skipped, budget spent")
            self.save()
            return
        self.log(f"{name}: start")
        began = time.perf_counter()
        try:
            result = fn(self)
        except Skip as why:
            result = {"skipped": str(why)}
        except Exception as err:  # recorded, the next section runs
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        if isinstance(result, dict):
            result["seconds"] = round(time.perf_counter() - began, 1)
        self.results[name] = result
        self.save()
        self.log(f"{name}: {_short(result)}")


class Skip(Exception):
    pass


def _short(result: Any) -> str:
    if not isinstance(result, dict):
        return str(result)[:200]
    keys = ("skipped", "error", "passed", "summary")
    return json.dumps({k: result[k] for k in keys if k in result}, default=str)[:400]


def _need_cuda() -> None:
    import onnxruntime as ort

    if BACKEND != "ort-cuda":
        return
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Skip(f"no CUDAExecutionProvider in this onnxruntime ({ort.__version__}: {ort.get_available_providers()})")


# -- preparation (CPU or GPU): HF folders and exports -------------------------------------------------
def hf_folder(run: Run, recipe: str) -> Path:
    from kvforge.models.recipes import materialize

    folder = run.work / "hf" / recipe
    if not (folder / "config.json").is_file():
        materialize(recipe, folder, force=True)
    return folder


def export(run: Run, recipe: str, target: str = "ort", dtype: str = "fp16", merge_pairs: bool | None = None) -> Path:
    from kvforge.exporter.export import export_model

    folder = run.work / "exports" / _export_name(recipe, target, dtype, merge_pairs)
    started = run.background.pop(folder.name, None)
    if started is not None:  # exported beside the earlier sections (export is CPU work): wait for it
        started.wait()
    if not (folder / "kvforge.json").is_file():
        export_model(hf_folder(run, recipe), folder, target=target, dtype=dtype, force=True, merge_pairs=merge_pairs)
    return folder


def _export_name(recipe: str, target: str, dtype: str, merge_pairs: bool | None) -> str:
    return f"{recipe}-{target}-{dtype}{'' if merge_pairs is None else '-pairs' if merge_pairs else '-nopairs'}"


def _export_in_background(run: Run, recipe: str, merge_pairs: bool | None) -> None:
    """Start `export(run, recipe, merge_pairs=...)` in its own process; `export` waits for it."""
    name = _export_name(recipe, "ort", "fp16", merge_pairs)
    if (run.work / "exports" / name / "kvforge.json").is_file():
        return
    hf = hf_folder(run, recipe)
    code = ("import sys; from kvforge.exporter.export import export_model; "
            f"export_model({str(hf)!r}, {str(run.work / 'exports' / name)!r}, target='ort', dtype='fp16', force=True, "
            f"merge_pairs={merge_pairs!r})")
    log = open(run.out / f"export_{name}.log", "w")  # noqa: SIM115 (the process writes it)
    run.background[name] = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


# Issue 35's kinds: model types of the coverage sweep, built from their tiny sweep configs.
NEW_KINDS = ("gemma4_text", "deepseek_v3", "deepseek_v32", "bamba", "mamba", "rwkv", "bloom")


def tiny_export(run: Run, model_type: str, dtype: str = "fp16") -> tuple[Path, Path]:
    """(HF folder, `ort` export) of a coverage-sweep type's tiny config, made when missing."""
    from kvforge.exporter.export import export_model
    from kvforge.tools.coverage_fixtures import build_tiny

    hf = run.work / "hf" / model_type
    if not (hf / "config.json").is_file():
        build_tiny(model_type, hf)
    folder = run.work / "exports" / f"{model_type}-ort-{dtype}"
    if not (folder / "kvforge.json").is_file():
        export_model(hf, folder, target="ort", dtype=dtype, force=True)
    return hf, folder


def prepare(run: Run) -> dict[str, Any]:
    from kvforge.models.recipes import FAMILY_RECIPES

    made = []
    for recipe in FAMILY_RECIPES:
        export(run, recipe)
        made.append(f"{recipe}-ort-fp16")
    export(run, "llama-tiny", "ort", "bf16")
    export(run, "llama-tiny", "onnx", "fp16")
    for model_type in NEW_KINDS:
        tiny_export(run, model_type)
    from gpu_speculation import draft_export, eagle_export

    draft_export(run.work, hf_folder(run, "llama-tiny"), "fp16")
    eagle_export(run.work, "fp16")
    return {"exports": made + ["llama-tiny-ort-bf16", "llama-tiny-onnx-fp16"] + [f"{t}-ort-fp16" for t in NEW_KINDS]
            + ["llama-tiny-int4-fp16", "eagle3/ort-fp16"]}


# -- checks -----------------------------------------------------------------------------------------
def env(run: Run) -> dict[str, Any]:
    from kvforge.tools.doctor import diagnose

    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True) if _which("nvidia-smi") else None
    if smi is not None:
        (run.out / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
    report = diagnose()
    return {"doctor": report, "summary": {k: v["runs_here"] for k, v in report["backends"].items()}}


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def _greedy(generator: Any, prompts: list[list[int]], new: int = 32, **options: Any) -> list[list[int]]:
    return generator.generate(prompts, max_new_tokens=new, greedy=True, ignore_eos=True, **options).tokens


def _memcpy_nodes(folder: Path, phase: str, out: Path) -> dict[str, Any]:
    """Memcpy nodes ONNX Runtime puts into `phase`'s graph for the CUDA provider (its optimised model):
    each with what it copies and who reads the copy."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from kvforge.core.manifest import load_manifest

    manifest = load_manifest(folder)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / f"optimized_{phase}.onnx"
        options.optimized_model_filepath = str(target)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(folder / manifest["graphs"][phase]["file"]), options,
                             providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        graph = onnx.load(str(target), load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output}
    copies = []
    for node in graph.node:
        if node.op_type.startswith("Memcpy"):
            source = producers.get(node.input[0])
            readers = [f"{n.op_type}:{n.name}" for n in graph.node if node.output[0] in n.input]
            copies.append({"op": node.op_type, "copies": node.input[0],
                           "from": f"{source.op_type}:{source.name}" if source is not None else "graph input",
                           "readers": readers[:4]})
    ops: dict[str, int] = {}
    for node in graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return {"memcpy": copies, "optimised_ops": ops}


def decode(run: Run) -> dict[str, Any]:
    """llama-tiny fp16 against Hugging Face (parity: logits per step, greedy tokens, near ties allowed), in
    three ways: CUDA graphs (the default), no CUDA graphs, one session for both phases. Their tokens must
    be the same; the cache is written in place; ONNX Runtime adds no Memcpy node to the decode graph."""
    _need_cuda()
    from kvforge.runtime import Generator
    from kvforge.runtime.drivers import inspection
    from kvforge.tools.parity import run_parity

    folder = export(run, "llama-tiny")
    variants = (("graphs", {}), ("no_graphs", {"cuda_graphs": False}), ("single", {"sessions": "single"}))
    if BACKEND != "ort-cuda":
        variants = (("graphs", {}), ("no_graphs", {"sessions": "separate"}), ("single", {"sessions": "single"}))
    result: dict[str, Any] = {}
    tokens = {}
    for label, options in variants:
        report = run_parity(hf_folder(run, "llama-tiny"), folder, new_tokens=32, backend=BACKEND,
                            backend_options=options, perplexity_tokens=256)
        tokens[label] = [p.export_tokens for p in report.prompts]
        result[label] = {"passed": report.passed, "max_abs_err": round(float(report.max_abs_err), 4),
                         "mismatched": [p.mismatched_steps for p in report.prompts],
                         "ties": [p.tie_steps for p in report.prompts], "summary": report.summary().splitlines()[-1]}
    result["same_tokens_all_variants"] = tokens["graphs"] == tokens["no_graphs"] == tokens["single"]
    gen = Generator(folder, backend=BACKEND)
    result["cuda_graphs"], result["sessions"] = gen.backend.cuda_graphs, gen.backend.session_mode
    result["cuda_graphs_refused"] = getattr(gen.backend, "cuda_graphs_refused", None)
    first = [_greedy(gen, [p])[0] for p in PROMPTS]
    result["repeat_equal"] = [_greedy(gen, [p])[0] for p in PROMPTS] == first  # replays = the capture run
    in_place = []
    for event in gen.stream([PROMPTS[0]], max_new_tokens=6, greedy=True, ignore_eos=True):
        addresses = inspection.kv_addresses(gen)
        bound = inspection.bound_output_addresses(gen, "prefill" if event.step == 0 else "decode")
        in_place.append({n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses)
    result["in_place"] = all(in_place)
    try:
        result["memcpy_nodes"] = {phase: _memcpy_nodes(folder, phase, run.out) for phase in ("prefill", "decode")} \
            if BACKEND == "ort-cuda" else "not on the CPU"
    except Exception as err:
        result["memcpy_nodes"] = f"{type(err).__name__}: {err}"
    result["passed"] = all(result[label]["passed"] for label, _ in variants) and result["same_tokens_all_variants"] \
        and result["in_place"] and result["repeat_equal"]
    return result


def families(run: Run) -> dict[str, Any]:
    _need_cuda()
    from kvforge.models.recipes import FAMILY_RECIPES
    from kvforge.runtime import Generator
    from kvforge.tools.parity import run_parity

    out: dict[str, Any] = {}
    for recipe in FAMILY_RECIPES:
        try:
            folder = export(run, recipe)
            report = run_parity(hf_folder(run, recipe), folder, new_tokens=32, backend=BACKEND,
                                perplexity_tokens=512)
            with_graphs = [p.export_tokens for p in report.prompts]
            plain = Generator(folder, backend=BACKEND, **({"cuda_graphs": False} if BACKEND == "ort-cuda" else {}))
            without = [_greedy(plain, [plain.tokenizer.encode(p.prompt)])[0] for p in report.prompts]
            out[recipe] = {"passed": report.passed, "max_abs_err": round(float(report.max_abs_err), 4),
                           "mismatched": [p.mismatched_steps for p in report.prompts],
                           "ties": [p.tie_steps for p in report.prompts],
                           "perplexity": report.perplexity, "graphs_equal_no_graphs": with_graphs == without,
                           "cuda_graphs": _graphs_state(folder),
                           "summary": report.summary().splitlines()[0]}
        except Exception as err:
            out[recipe] = {"passed": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}
        run.log(f"  {recipe}: {_short(out[recipe])}")
    return {"families": out, "passed": all(v.get("passed") and v.get("graphs_equal_no_graphs") for v in out.values()),
            "summary": {k: bool(v.get("passed")) for k, v in out.items()}}


def _graphs_state(folder: Path) -> Any:
    """Whether the default ort-cuda backend captures decode steps here, or ONNX Runtime's reason why not."""
    from kvforge.runtime import Generator

    backend = Generator(folder, backend=BACKEND).backend
    return backend.cuda_graphs or backend.cuda_graphs_refused


def _parity_of(run: Run, recipe: str, target: str, dtype: str) -> dict[str, Any]:
    _need_cuda()
    from kvforge.tools.parity import run_parity

    folder = export(run, recipe, target, dtype)
    report = run_parity(hf_folder(run, recipe), folder, new_tokens=32, backend=BACKEND, perplexity_tokens=512)
    return {"passed": report.passed, "max_abs_err": round(float(report.max_abs_err), 4),
            "report": report.to_dict(), "summary": report.summary().splitlines()[0]}


def bf16(run: Run) -> dict[str, Any]:
    return _parity_of(run, "llama-tiny", "ort", "bf16")


def onnx_target(run: Run) -> dict[str, Any]:
    return _parity_of(run, "llama-tiny", "onnx", "fp16")


def batch(run: Run) -> dict[str, Any]:
    _need_cuda()
    from kvforge.runtime import Generator

    gen = Generator(export(run, "llama-tiny"), backend=BACKEND)
    solo = [_greedy(gen, [p])[0] for p in PROMPTS]
    batched = _greedy(gen, PROMPTS)
    lookup = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]]
    plain = _greedy(gen, lookup, 40)
    speculative = gen.generate(lookup, max_new_tokens=40, greedy=True, ignore_eos=True, speculate="prompt-lookup")
    return {"batch_equal_solo": batched == solo, "speculation_equal_greedy": speculative.tokens == plain,
            "accepted": f"{speculative.accepted_tokens}/{speculative.draft_tokens}",
            "passed": batched == solo and speculative.tokens == plain}


def serving(run: Run) -> dict[str, Any]:
    _need_cuda()
    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.scheduler import Scheduler

    folder = export(run, "llama-tiny")
    gen = Generator(folder, backend=BACKEND)
    lengths = [3, 20, 7, 12, 5, 16]
    prompts = [PROMPTS[i % 3] + [40 + i] * i for i in range(len(lengths))]
    solo = [_greedy(gen, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)]
    scheduler = Scheduler(gen, max_batch=4, max_seq_len=128, prefill_chunk=4).start()
    try:
        handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True))
                   for p, n in zip(prompts, lengths, strict=True)]
        served = [h.result()[0] for h in handles]
        first = prompts[1] + served[1][:-1]
        follow = first + [served[1][-1], 9, 10]
        tokens, _, done = scheduler.submit(GenerationRequest(follow, 6, SamplingConfig(greedy=True),
                                                             ignore_eos=True)).result()
        second_turn = {"cached_tokens": done.cached_tokens, "equal_solo": tokens == _greedy(gen, [follow], 6)[0]}
    finally:
        scheduler.close()
    result = {"served_equal_solo": served == solo, "second_turn": second_turn,
              "passed": served == solo and second_turn["equal_solo"] and done.cached_tokens == len(first)}
    result["http"] = _serve_http(run, folder, gen)
    return result


def new_kinds(run: Run) -> dict[str, Any]:
    _need_cuda()
    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.scheduler import Scheduler
    from kvforge.tools.parity import run_parity

    out: dict[str, Any] = {}
    for model_type in NEW_KINDS:
        try:
            hf, folder = tiny_export(run, model_type)
            report = run_parity(hf, folder, new_tokens=24, backend=BACKEND, perplexity_tokens=0)
            gen = Generator(folder, backend=BACKEND)
            prompts = [PROMPTS[i % 3] + [40 + i] * i for i in range(4)]
            solo = [_greedy(gen, [p], 12)[0] for p in prompts]
            scheduler = Scheduler(gen, max_batch=2, max_seq_len=128, prefill_chunk=4).start()
            try:
                handles = [scheduler.submit(GenerationRequest(p, 12, SamplingConfig(greedy=True), ignore_eos=True))
                           for p in prompts]
                served = [h.result()[0] for h in handles]
            finally:
                scheduler.close()
            out[model_type] = {"parity": report.passed, "max_abs_err": round(float(report.max_abs_err), 4),
                               "batch_equal_solo": _greedy(gen, prompts, 12) == solo, "served_equal_solo": served == solo,
                               "summary": report.summary().splitlines()[0]}
            out[model_type]["passed"] = all(out[model_type][k] for k in ("parity", "batch_equal_solo", "served_equal_solo"))
        except Exception as err:
            out[model_type] = {"passed": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}
        run.log(f"  {model_type}: {_short(out[model_type])}")
    return {"kinds": out, "passed": all(v.get("passed") for v in out.values())}


def _serve_http(run: Run, folder: Path, gen: Any) -> dict[str, Any]:
    """`kvforge serve --backend ort-cuda` in its own process: greedy completions equal the Generator's."""
    import importlib.util

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("httpx") is None:
        return {"skipped": "fastapi/httpx not installed"}
    import httpx

    port = 8765
    server = subprocess.Popen([sys.executable, "-m", "kvforge.cli", "serve", str(folder), "--backend", BACKEND,
                               "--port", str(port), "--max-batch", "4", "--log-format", "off"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        texts = ["Once upon a time", "The quick brown fox", "def main(): return"]
        from concurrent.futures import ThreadPoolExecutor

        def ask(text: str) -> str:
            body = {"model": folder.name, "prompt": text, "max_tokens": 12, "temperature": 0}
            return httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, texts))
        expected = [gen.generate([t], max_new_tokens=12, greedy=True).text[0] for t in texts]
        return {"equal_generator": answers == expected, "answers": answers, "expected": expected}
    finally:
        server.terminate()
        try:
            _, err = server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
        (run.out / "serve_stderr.txt").write_text(err[-20000:])


def bench(run: Run) -> dict[str, Any]:
    if BACKEND != "ort-cuda":
        raise Skip("the GPU benchmark needs --backend ort-cuda")
    _need_cuda()
    from kvforge.tools.bench_gpu import format_gpu_table, run_gpu_bench

    began = time.perf_counter()
    folder = export(run, "smollm2-135m-shape")
    result: dict[str, Any] = {"export_seconds": round(time.perf_counter() - began, 1)}
    run.log(f"  smollm2-135m-shape exported in {result['export_seconds']} s")
    try:
        result["graphs"] = {phase: _memcpy_nodes(folder, phase, run.out) for phase in ("prefill", "decode")}
        import onnx_ir as ir

        decode_graph = ir.load(folder / "decode.onnx")
        first = next(n for n in decode_graph.graph if n.op_type == "GroupQueryAttention")
        result["decode_gqa_inputs"] = [(v.name, v.producer().op_type if v is not None and v.producer() else None)
                                       if v is not None else None for v in first.inputs]
    except Exception as err:
        result["graphs"] = f"{type(err).__name__}: {err}"
    run.log(f"  graphs: {json.dumps(result['graphs'], default=str)[:1500]}")
    # What `kvforge bench EXPORT --backend ort-cuda --compare hf,hf-compiled --batch 1,8 --json` runs (the same
    # function), with a time limit per system so that a slow compilation costs only its own figures.
    # kvforge and Hugging Face eager take ~20 s each; torch.compile gets the rest of the budget.
    # A/B rows first (kvforge only, ~6 s each), then the figures of record with the peers.
    nopairs = export(run, "smollm2-135m-shape", merge_pairs=False)
    rows = (("flash_attention", folder, {"decode_attention": "flash"}, ()), ("host_greedy", folder, {"device_greedy": False}, ()),
            ("nopairs", nopairs, {}, ()), ("bench", folder, {}, PEERS))
    for label, where, options, peers in rows:
        left = run.budget - (time.perf_counter() - run.started) - 10
        if left < 40:
            result[label] = {"skipped": "time budget spent"}
            continue
        report = run_gpu_bench(where, "ort-cuda", (1, 8), repeat=5, compare=peers, say=run.log,
                               backend_options=options, worker_timeout=max(30.0, left - 45))
        result[label] = report
        table = format_gpu_table(report)
        (run.out / f"bench_{label}.json").write_text(json.dumps(report, indent=1))
        (run.out / f"bench_{label}.txt").write_text(table + "\n")
        run.log("\n" + table)
    result["passed"] = all("error" not in v for v in result.values() if isinstance(v, dict))
    return result


def step_profile(run: Run) -> dict[str, Any]:
    """benchmarks/gpu_step_profile.py on the SmolLM2-shape export: the decode step's time, replay against
    the host work around it, and its kernels (CUPTI)."""
    if BACKEND != "ort-cuda":
        raise Skip("the step profile needs --backend ort-cuda")
    _need_cuda()
    script = Path(__file__).with_name("gpu_step_profile.py")
    text, ok = "", True
    for folder, variants in ((export(run, "smollm2-135m-shape"), "default,flash-attention,host-greedy"),
                             (export(run, "smollm2-135m-shape", merge_pairs=False), "default")):
        proc = subprocess.run([sys.executable, str(script), str(folder), "--out", str(run.out / folder.name),
                               "--variants", variants, "--steps", "200"], capture_output=True, text=True, timeout=300)
        text += f"== {folder.name}\n{proc.stdout}\n{proc.stderr[-3000:] if proc.returncode else ''}"
        ok = ok and proc.returncode == 0
        run.log(f"\n== {folder.name}\n" + proc.stdout)
    (run.out / "step_profile.txt").write_text(text)
    return {"passed": ok, "summary": text[-300:]}


def speculation(run: Run) -> dict[str, Any]:
    _need_cuda()
    from gpu_speculation import speculation as check

    return check(run, BACKEND, hf_folder, export)


SECTIONS: dict[str, Callable[[Run], Any]] = {
    "env": env, "decode": decode, "families": families, "bf16": bf16, "onnx": onnx_target, "batch": batch,
    "serving": serving, "speculation": speculation, "new_kinds": new_kinds, "bench": bench,
    "step_profile": step_profile,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--work", default=".gpu/work", help="HF folders and exports (made here when missing)")
    parser.add_argument("--prepare-only", action="store_true", help="make the HF folders and tiny exports, then stop")
    parser.add_argument("--only", default="", help=f"comma-separated sections ({', '.join(SECTIONS)})")
    parser.add_argument("--budget", type=float, default=540, help="seconds; later sections skip when it is spent")
    parser.add_argument("--backend", default="ort-cuda", choices=["ort-cuda", "ort-cpu"],
                        help="ort-cpu: the same checks on the CPU (tests this script)")
    parser.add_argument("--peers", default="hf,hf-compiled", help="the benchmark's peers (comma-separated; '' for none)")
    args = parser.parse_args()
    global BACKEND, PEERS
    BACKEND = args.backend
    PEERS = tuple(p for p in args.peers.split(",") if p)
    run = Run(Path(args.out), Path(args.work).absolute(), args.budget)
    if args.prepare_only:
        run.section("prepare", prepare)
        return
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS)
    if BACKEND == "ort-cuda" and {"step_profile", "bench"} & set(chosen):
        _export_in_background(run, "smollm2-135m-shape", None)
        _export_in_background(run, "smollm2-135m-shape", False)
    for name in chosen:
        run.section(name, SECTIONS[name])
    run.log("summary: " + json.dumps({name: _short(result) for name, result in run.results.items()}, default=str))


if __name__ == "__main__":
    main()
