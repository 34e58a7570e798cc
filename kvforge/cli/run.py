"""The `kvforge` commands that run an export: generate | parity | bench | serve (registered on the
group in kvforge/cli/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvforge.cli.common import (
    BACKEND_CHOICES,
    backend_options,
    chat_template_option,
    check_utf8,
    command_progress,
    emit_json,
    emulation_option,
    json_option,
    model_source,
    no_spin_option,
    parse_ids,
    refuse_unused,
    require_export_extra,
    revision_option,
    sampling_keywords,
    sampling_options,
)
from kvforge.cli.speculation import (
    check_flags,
    check_serve_flags,
    serve_speculation_options,
    speculation_options,
)
from kvforge.core.errors import InputError, ParityError
from kvforge.tools import speculation

if TYPE_CHECKING:  # the runtime is imported by the commands that run it (startup time)
    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.media.video import Video


@click.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Comma-separated token ids (repeat for a batch).")
@click.option("--chat", "chat_text", help="A user message, answered through the export's chat template.")
@click.option("--system", "system_text", help="With --chat: a system message first.")
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path), help="A vision-language export: "
              "an image file for the one prompt (repeatable), at each '<image>' in it, else before its text; with "
              "--chat, an image part before the message's text, placed by the chat template.")
@click.option("--video", "videos", multiple=True, help="A vision-language export that takes videos (Qwen2-VL, "
              "Qwen2.5-VL): a folder of frame images (in name order) or comma-separated frame files, already sampled, "
              "at each '<video>' of the prompt (repeatable); with --chat, a video part.")
@click.option("--video-fps", type=float, default=None, help="The rate --video's frames were sampled at (default 2).")
@click.option("--max-new-tokens", default=64, show_default=True, type=int, help="Most tokens generated per prompt.")
@sampling_options
@click.option("--capacity", type=int, help="KV cache capacity (default: longest prompt + max new tokens).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="ort-cpu (default for ort/onnx exports), ort-cuda, tensorrt (TensorRT engines from `kvforge "
                   "build`), or emulate (default for trt exports: the TensorRT plugin emulated on the CPU).")
@click.option("--threads", type=int, help="ONNX Runtime backends: intra-op threads (default: ONNX Runtime's choice).")
@click.option("--sessions", type=click.Choice(["single", "shared", "separate"]), default=None,
              help="ONNX Runtime backends: single (default: one session runs both phases, one weight copy), "
                   "shared (both graphs over one memory-mapped copy), separate (both graphs, two copies).")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="tensorrt backend: the engines (default EXPORT_DIR/engines).")
@emulation_option
@no_spin_option
@click.option("--stream", is_flag=True, help="Print text as it is generated (single prompt).")
@click.option("--verify", is_flag=True, help="Re-hash every file (weights too) against the manifest before loading.")
@click.option("--ignore-eos", is_flag=True, help="Run to --max-new-tokens even past end-of-sequence tokens.")
@speculation_options()
@json_option("the results (tokens, text, timings; with --speculate, the drafts and what was accepted)")
def generate(export_dir: Path, stream: bool, as_json: bool, **options: Any) -> None:
    """Generate from an export folder."""
    from kvforge.runtime import Generator, LoadedExport
    from kvforge.runtime.text.prompts import RenderedChat

    check_flags(options["speculate"], options["draft"], options["draft_len"])
    if sum(map(bool, (options["prompts"], options["prompt_ids"], options["chat_text"] is not None))) != 1:
        raise InputError("give --prompt TEXT, --prompt-ids 1,2,3 (repeatable for a batch) or --chat TEXT (one of them)")
    if options["system_text"] is not None and options["chat_text"] is None:
        raise InputError("--system goes with --chat")
    for option in ("chat_text", "system_text"):  # (--prompt texts are checked with the prompts)
        check_utf8(f"--{option.removesuffix('_text')}", options[option])
    batch = list(options["prompts"]) or [parse_ids(ids) for ids in options["prompt_ids"]]  # checked before loading
    from kvforge.cli.seq2seq import generate_seq2seq
    from kvforge.core.encoder_contract import is_encoder_decoder

    if is_encoder_decoder(export_dir):  # the sources go to the encoder (kvforge/cli/seq2seq.py)
        return generate_seq2seq(export_dir, batch, {**options, "stream": stream}, as_json)
    if (options["images"] or options["videos"]) and len(batch) > 1:
        raise InputError("--image and --video go with one prompt (one --prompt, --prompt-ids or --chat)")
    loading = backend_options(threads=options["threads"], sessions=options["sessions"],
                              engine_dir=options["engine_dir"], emulation=options["emulation"],
                              spinning=False if options["no_spin"] else None)
    loading = speculation.target_options(export_dir, options["backend"], options["speculate"], loading)
    export = LoadedExport(export_dir, backend=options["backend"], verify_hashes=options["verify"], **loading)
    speculation.check_target(export, options["speculate"])
    draft = (speculation.open_draft(options["draft"], export, **backend_options(threads=options["threads"]))
             if options["draft"] is not None else None)
    generator = Generator(export, draft=draft)
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
    spec = request.speculation
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
    if spec is not None:
        payload["speculation"] = speculation.report(spec.method, spec.draft_len, result.draft_tokens,
                                                    result.accepted_tokens, result.drafted_at, result.accepted_at,
                                                    result.verify_steps, result.tokens_per_step)
    if as_json:
        emit_json(payload)
        return
    if not streaming:
        for i, tokens in enumerate(result.tokens):
            prefix = f"[{i}] " if len(result.tokens) > 1 else ""
            click.echo(prefix + (result.text[i] if result.text is not None else ",".join(map(str, tokens))))
    click.echo(
        f"ttft {result.ttft_ms:.1f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s, "
        f"{sum(map(len, result.tokens))} tokens generated"
        + (f", {speculation.summary(payload['speculation'])}" if spec is not None else ""),
        err=True,
    )
    cut = [i for i, reason in enumerate(result.finish_reason) if reason == "length"]
    if cut and not request.ignore_eos:
        which = "" if len(result.finish_reason) == 1 else f" (prompt {', '.join(map(str, cut))})"
        click.echo(f"stopped at --max-new-tokens ({request.max_new_tokens}){which}, not at an end-of-sequence token; "
                   "raise --max-new-tokens for a longer answer", err=True)


def _video(value: str, fps: float | None) -> Video:
    """--video's value: a folder of frames, or comma-separated frame files."""
    from kvforge.runtime.media.video import Video, video_from_path

    if "," in value:
        return Video(tuple(Path(part) for part in value.split(",") if part), fps)
    return video_from_path(value, fps)


def _generation_request(generator: Generator, batch: list[Any], options: dict[str, Any]) -> GenerationRequest:
    """The GenerationRequest of `kvforge generate`'s options: the prompts (`batch`) or the chat,
    sampling, limits, speculation."""
    from kvforge.runtime.media.video import Video
    from kvforge.runtime.text.prompts import RenderedChat

    images = [*options["images"], *(_video(path, options["video_fps"]) for path in options["videos"])] or None
    if options["chat_text"] is not None:
        messages = ([{"role": "system", "content": options["system_text"]}] if options["system_text"] is not None
                    else [])
        messages.append({"role": "user", "content": options["chat_text"]})
        if generator.images is not None:  # image parts: the template says where they go, as the processor's
            messages[-1]["content"] = [*({"type": "video", "video": one} if isinstance(one, Video) else
                                         {"type": "image", "image": one} for one in images or ()),
                                       {"type": "text", "text": options["chat_text"]}]
            ids, images = generator.chat_inputs(messages)
            images = images or None
        else:
            ids = generator.chat_ids(messages)
        prompts: Any = RenderedChat(ids)
    else:
        prompts = batch[0] if images else batch
    sampling = sampling_keywords(options)  # speculation keeps either: greedy's tokens, or sampling's distribution
    return generator.request(prompts, options["max_new_tokens"], capacity=options["capacity"],
                             ignore_eos=options["ignore_eos"], speculate=options["speculate"],
                             draft_len=options["draft_len"], images=images, **sampling)


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--new-tokens", default=32, show_default=True, type=int, help="Greedy tokens compared per prompt.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (default: a few built-in prompts).")
@click.option("--atol", type=float, help="Max abs logit error allowed (default: 1e-3 fp32, 0.15 fp16).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="The backend to check (default: the one `kvforge generate` runs by default).")
@click.option("--sessions", type=click.Choice(["shared", "single", "separate"]), default=None,
              help="ONNX Runtime backends: single (default, as generate), shared or separate (run decode.onnx too).")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="tensorrt backend: the engines (default EXPORT_DIR/engines).")
@emulation_option
@click.option("--against", type=click.Choice(BACKEND_CHOICES), default=None,
              help="Also compare with another backend (same tolerance, same prompts).")
@click.option("--perplexity-tokens", default=1024, show_default=True, type=int,
              help="Perplexity of export vs HF on this many tokens of kvforge's fixed text (0: skip).")
@revision_option
@json_option("the report (per-prompt errors, perplexity)")
def parity(model_dir: Path, export_dir: Path, new_tokens: int, prompts: tuple[str, ...], atol: float | None,
           backend: str | None, sessions: str | None, engine_dir: Path | None, emulation: str | None,
           against: str | None, perplexity_tokens: int, as_json: bool, revision: str | None) -> None:
    """Compare EXPORT_DIR against Hugging Face eager on MODEL_DIR (a local folder, or a Hub id `org/name` as
    export takes it); exit 1 beyond tolerance."""
    require_export_extra("parity")
    model_dir = model_source(model_dir, revision)
    from kvforge.core.encoder_contract import is_encoder_decoder

    if is_encoder_decoder(export_dir):  # the decoder's logits on its greedy path (kvforge/tools/seq2seq_accuracy.py)
        from kvforge.tools.seq2seq_accuracy import seq2seq_parity

        return seq2seq_parity(model_dir, export_dir, atol, as_json, emit_json, click.echo)
    from kvforge.tools.parity import run_parity

    progress = command_progress(as_json)
    report = run_parity(model_dir, export_dir, prompts=list(prompts) or None, new_tokens=new_tokens,
                        atol=atol, backend=backend, progress=progress, sessions=sessions,
                        against=against, backend_options=backend_options(engine_dir=engine_dir, emulation=emulation),
                        perplexity_tokens=perplexity_tokens)
    progress.close()
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(report.summary())
    if not report.passed:
        raise ParityError(report.failure_reason())


@click.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--prompt-len", default=128, show_default=True, type=int, help="Prompt tokens per row.")
@click.option("--new-tokens", default=128, show_default=True, type=int, help="Tokens decoded per row.")
@click.option("--batch", default=None,
              help="Rows (prompts of different lengths); GPU backends take a list, e.g. 1,8. [default: 1; GPU: 1,8]")
@click.option("--repeat", default=None, type=int,
              help="Rounds (CPU, default 3) or timed runs after a warm-up (GPU, default 5); medians are reported.")
@click.option("--threads", default=2, show_default=True, type=int, help="Threads each system runs with.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="ort-cuda or tensorrt: the GPU benchmark (peers hf, hf-compiled on the same GPU). Default: the CPU one.")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="tensorrt backend: the engines (default EXPORT_DIR/engines).")
@click.option("--compare", default="", help="Peers, comma-separated: hf, ort-genai (CPU); hf, hf-compiled (GPU).")
@click.option("--plot", type=click.Path(path_type=Path), help="Draw the comparison to this PNG (matplotlib; CPU).")
@click.option("--speculate", type=click.Choice(["prompt-lookup", "draft", "eagle", "mtp"]), default=None,
              help="Also run kvforge with speculative decoding (alternating with plain): acceptance per draft position, "
                   "tokens per target step, tokens/s against plain and the peers.")
@click.option("--draft-len", default=6, show_default=True, type=int, help="With --speculate: most tokens drafted per step.")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path),
              help="With --speculate draft: the draft export (the target's vocabulary; e.g. its int4 export).")
@click.option("--prompt-file", type=click.Path(path_type=Path),
              help="A UTF-8 text whose first --prompt-len tokens are every system's prompt (default: token ids in a "
                   "progression, which a real model reads as noise).")
@click.option("--cold-start/--no-cold-start", default=True, show_default=True,
              help="Also time each system's cold start: a whole process from its start to its first token (CPU).")
@click.option("--mem-bandwidth", metavar="GB/S",
              help="Memory bandwidth in GB/s that each decode figure's share of the bandwidth limit is taken of "
                   "(e.g. 3350). Default: the CPU's, measured in every round; a GPU's datasheet figure by its name.")
@no_spin_option
@json_option("the report (medians, spreads, ratios)")
def bench(export_dir: Path, prompt_len: int, new_tokens: int, batch: str | None, repeat: int | None, threads: int,
          backend: str | None, engine_dir: Path | None, compare: str, plot: Path | None, speculate: str | None,
          draft_len: int, draft_dir: Path | None, prompt_file: Path | None, cold_start: bool, mem_bandwidth: str | None,
          no_spin: bool, as_json: bool) -> None:
    """Benchmark an export (TTFT, decode tokens/s and its share of the memory-bandwidth limit, memory), optionally
    against peers: on the CPU (ort-cpu, with cold start), or on a GPU with --backend ort-cuda / tensorrt."""
    from kvforge.tools import bench as bench_module
    from kvforge.tools.bandwidth import parse_mem_bandwidth
    from kvforge.tools.bench_gpu import GPU_BACKENDS

    refuse_unused("speculate", speculate is not None, "draft_len")
    peers = tuple(p.strip() for p in compare.split(",") if p.strip())
    batches = _batch_sizes(batch)
    gbps = parse_mem_bandwidth(mem_bandwidth)  # before any run
    if backend in GPU_BACKENDS:
        from kvforge.tools.bench_gpu import format_gpu_table, run_gpu_bench

        if plot is not None or speculate is not None or prompt_file is not None:
            raise InputError("--plot, --speculate and --prompt-file are options of the CPU benchmark, not of --backend "
                             + backend)
        progress = command_progress(False)
        report = run_gpu_bench(export_dir, backend, batches or (1, 8), prompt_len, new_tokens,
                               5 if repeat is None else repeat, peers, say=progress,
                               backend_options=backend_options(engine_dir=engine_dir), mem_bandwidth=gbps)
        progress.close()
        if as_json:
            emit_json(report)
        else:
            click.echo(format_gpu_table(report))
        return
    if backend not in (None, "ort-cpu"):
        raise InputError(f"kvforge bench runs ort-cpu (the CPU benchmark) or a GPU backend ({', '.join(GPU_BACKENDS)}), "
                         f"not {backend}")
    if batches is not None and len(batches) > 1:
        raise InputError("several --batch sizes are for the GPU benchmark (--backend ort-cuda); give one")
    if plot is not None:  # before the rounds, not after minutes of measuring
        bench_module.check_plot(plot)
    progress = command_progress(False)
    report = bench_module.run_bench(export_dir, prompt_len, new_tokens, batches[0] if batches else 1,
                                    3 if repeat is None else repeat, threads, peers, say=progress,
                                    speculate=speculate, draft_len=draft_len, cold_start=cold_start,
                                    spinning=not no_spin, mem_bandwidth=gbps, draft=draft_dir, prompt_file=prompt_file)
    progress.close()
    if plot is not None:
        bench_module.plot(report, plot)
        click.echo(f"kvforge: plot written to {plot}", err=True)
    if as_json:
        emit_json(report)
    else:
        click.echo(bench_module.format_table(report))


def _batch_sizes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InputError(f"--batch takes a size or a comma-separated list of sizes (1,8), got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise InputError(f"--batch sizes must be positive, got {text!r}")
    return sizes


@click.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: a free one, printed when serving).")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Rows of the running batch (requests decoded together).")
@click.option("--max-seq-len", type=click.IntRange(2), default=None,
              help="Positions per request, prompt + max_tokens (default: the export's max_capacity, at most 4096).")
@click.option("--prefill-chunk", default=128, show_default=True, type=click.IntRange(1),
              help="Prompt tokens prefilled per step between decode steps of the running batch.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Requests that may wait; more get HTTP 429.")
@click.option("--api-key", default=None,
              help="Require 'Authorization: Bearer KEY' on every path but /health and /metrics (default: none).")
@click.option("--max-body-bytes", default=2 << 20, show_default=True, type=click.IntRange(1024),
              help="Largest request body; bigger ones get HTTP 413 and are never parsed.")
@click.option("--max-audio-bytes", default=25 << 20, show_default=True, type=click.IntRange(1024),
              help="A speech export: the largest audio upload (bigger: HTTP 400 naming the limit).")
@click.option("--max-audio-seconds", default=1800.0, show_default=True, type=click.FloatRange(1),
              help="A speech export: the longest audio (longer: HTTP 400 naming the limit).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header is NAME (repeatable; '*': any). By default only the "
                   "bound address and loopback names are answered, against DNS rebinding.")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default=None,
              help="ort-cpu (default), ort-cuda, tensorrt or emulate: any backend with row operations serves.")
@click.option("--engine-dir", type=click.Path(path_type=Path), help="tensorrt backend: the engines (default EXPORT_DIR/engines).")
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime intra-op threads.")
@no_spin_option
@click.option("--log-format", type=click.Choice(["text", "json", "off"]), default="text", show_default=True,
              help="One line per request on stderr: key=value text, JSON objects, or none.")
@chat_template_option
@click.option("--special-tokens-in-content", is_flag=True,
              help="Let special-token text in chat messages (e.g. '<|im_end|>') become control tokens, as "
                   "transformers' templates do; by default it stays text, so a client cannot open a system "
                   "turn. Only for trusted clients.")
@serve_speculation_options
@click.option("--ray", "use_ray", is_flag=True, help="Serve through Ray Serve (replicas behind its HTTP proxy).")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(1), help="With --ray: replicas.")
@click.option("--ray-address", default=None, help="With --ray: a running cluster to join (default: start a local one).")
def serve(export_dir: Path, host: str, port: int, max_batch: int, max_seq_len: int | None, prefill_chunk: int,
          max_queue: int, api_key: str | None, max_body_bytes: int, max_audio_bytes: int, max_audio_seconds: float,
          allow_hosts: tuple[str, ...],
          backend: str | None, engine_dir: Path | None, threads: int | None, no_spin: bool, log_format: str,
          chat_template: str | None, special_tokens_in_content: bool, use_ray: bool, replicas: int,
          ray_address: str | None, speculate: str | None, draft: Path | None, draft_len: int,
          adaptive_draft: bool) -> None:
    """Serve an export over an OpenAI-compatible HTTP API with continuous batching.

    Stops on Ctrl-C (exit 130) or SIGTERM (exit 0) after finishing or cutting (after 5 s) open requests."""
    import signal

    from kvforge.serve.app import check_api_key

    check_api_key(api_key)  # before anything loads: a key no client can send is a mistake
    check_serve_flags(speculate, draft, draft_len)
    options = dict(max_batch=max_batch, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, max_queue=max_queue,
                   api_key=api_key, threads=threads, spinning=not no_spin, max_body_bytes=max_body_bytes,
                   chat_template=chat_template, backend=backend, engine_dir=engine_dir,
                   special_tokens_in_content=special_tokens_in_content, speculate=speculate, draft=draft,
                   draft_len=draft_len, adaptive_draft=adaptive_draft, max_audio_bytes=max_audio_bytes,
                   max_audio_seconds=max_audio_seconds)
    where = serving_where(use_ray, replicas) + speculating(speculate, draft_len, adaptive_draft)

    def ready(url: str | None = None) -> None:  # said once the app is built, so a bad export fails with one line only
        click.echo(f"kvforge: serving {export_dir} on {url or f'http://{host}:{port}/v1'} with {where} (Ctrl-C stops)",
                   err=True)

    if use_ray:
        if log_format != "text":  # the replicas' logging is Ray's; never a flag that silently does nothing
            raise click.UsageError("--log-format applies to the one-process server, not to --ray")
        from kvforge.serve.ray_serve import run as run_ray

        run_ray(export_dir, host=host, port=port, replicas=replicas, address=ray_address, ready=ready,
                allowed_hosts=sorted(_allowed(host, allow_hosts)), **options)
        return
    from kvforge.serve.app import serve as run_server

    def terminated(_signum: int, _frame: Any) -> None:  # SIGTERM while loading: a clean stop, not death by signal
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminated)
    stopped_by = run_server(export_dir, host=host, port=port, ready=ready, allow_hosts=allow_hosts,
                            log_format=log_format, **options)
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt  # kvforge: interrupted, exit 130 (cli._Group)
    if stopped_by == signal.SIGTERM:
        click.echo("kvforge: stopped (SIGTERM)", err=True)


def speculating(method: str | None, draft_len: int, adaptive: bool) -> str:
    """The ready line's words for the server's default speculation ('' for none)."""
    if method is None:
        return ""
    return f", speculating by {method} (up to {draft_len} tokens{', adaptive' if adaptive else ''})"


def serving_where(use_ray: bool, replicas: int) -> str:
    """What serves the requests, as the ready line says it: 'one process', '1 Ray Serve replica', '2 ... replicas'."""
    if not use_ray:
        return "one process"
    return f"{replicas} Ray Serve replica{'' if replicas == 1 else 's'}"


def _allowed(host: str, allow_hosts: tuple[str, ...]) -> frozenset[str]:
    from kvforge.serve.app import allowed_hosts_for

    return allowed_hosts_for(host, allow_hosts)
