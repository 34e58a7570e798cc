"""`kvforge generate` on an encoder-decoder export (kvforge/core/encoder_contract.py): each --prompt (or --prompt-ids)
is a source the encoder reads once, and the decoder writes its answer (runtime/drivers/seq2seq.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from kvforge.cli.common import emit_json, sampling_keywords
from kvforge.core.errors import InputError

# generate's options that mean nothing for an encoder-decoder (no chat template, images, drafts or engines yet).
_REFUSED = {"chat_text": "--chat", "system_text": "--system", "images": "--image", "videos": "--video",
            "speculate": "--speculate", "draft": "--draft", "engine_dir": "--engine-dir", "capacity": "--capacity"}


def generate_seq2seq(export_dir: Path, batch: list[Any], options: dict[str, Any], as_json: bool) -> None:
    """Generate for each source of `batch` (texts, or token id lists) and print (or emit as JSON) the answers."""
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator

    named = [flag for key, flag in _REFUSED.items() if options.get(key)]
    if named or options.get("backend") not in (None, "ort-cpu") or options.get("stream"):
        named += [f"--backend {options['backend']}"] if options.get("backend") not in (None, "ort-cpu") else []
        named += ["--stream"] if options.get("stream") else []
        raise InputError(f"{export_dir} is an encoder-decoder export: {', '.join(named)} is not supported for it yet; "
                         "give the source texts with --prompt (or --prompt-ids)")
    generator = Seq2SeqGenerator(export_dir, threads=options.get("threads"))
    texts = isinstance(batch[0], str)
    sources = [generator.tokenizer().encode(text) for text in batch] if texts else batch
    started = time.perf_counter()
    encoded = generator.encode_ids(sources)
    encoded_at = time.perf_counter()
    given = {key: value for key, value in sampling_keywords(options).items() if value is not None and key != "greedy"}
    # Greedy unless a sampling setting is given (the checkpoint's sampling defaults are not read yet).
    sampling = SamplingConfig(greedy=bool(options["greedy"]) or not given, **given)
    tokens = generator.generate_ids(encoded, options["max_new_tokens"], sampling=sampling)
    done = time.perf_counter()
    text = [generator.text(row) for row in tokens] if texts else None
    generated = sum(map(len, tokens))
    payload = {"tokens": tokens, "text": text, "source_tokens": [len(s) for s in sources],
               "finish_reason": [generator.finish_reason(row, options["max_new_tokens"]) for row in tokens],
               "encode_ms": round((encoded_at - started) * 1e3, 3), "decode_ms": round((done - encoded_at) * 1e3, 3),
               "decode_tokens_per_s": round(generated / max(done - encoded_at, 1e-9), 2), "backend": "ort-cpu"}
    if as_json:
        emit_json(payload)
        return
    for i, row in enumerate(tokens):
        prefix = f"[{i}] " if len(tokens) > 1 else ""
        click.echo(prefix + (text[i] if text is not None else ",".join(map(str, row))))
    click.echo(f"encode {payload['encode_ms']:.1f} ms, decode {payload['decode_tokens_per_s']:.1f} tokens/s, "
               f"{generated} tokens generated", err=True)


@click.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.argument("audio", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--language", default=None, help="The spoken language's code (en, de, ...); default: detected from the "
              "first 30 s.")
@click.option("--task", type=click.Choice(["transcribe", "translate"]), default="transcribe", show_default=True,
              help="translate: the speech's text in English.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int, help="Most tokens per 30 s window.")
@click.option("--timestamps", is_flag=True, help="Decode Whisper's timestamps too: timed segments (printed as "
              "[start --> end] lines; with --json, each window's segments).")
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads (default: ONNX Runtime's choice).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (text, language, each window's "
              "start, text and tokens).")
def transcribe(export_dir: Path, audio: tuple[Path, ...], language: str | None, task: str, max_new_tokens: int,
               timestamps: bool, threads: int | None, as_json: bool) -> None:
    """Transcribe audio files (WAV, FLAC) with a Whisper export, 30 s window by window."""
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator
    from kvforge.runtime.drivers.transcribe import Transcriber

    for path in audio:  # every file checked before the model loads
        if not path.is_file():
            raise InputError(f"{path} is not a file; pass WAV or FLAC audio files")
    transcriber = Transcriber(Seq2SeqGenerator(export_dir, threads=threads))
    results = []
    for path in audio:
        started = time.perf_counter()
        found = transcriber.transcribe(path, language=language, task=task, max_new_tokens=max_new_tokens,
                                       timestamps=timestamps)
        results.append({"file": str(path), "text": found.text, "language": found.language, "windows": found.windows,
                        "seconds": round(time.perf_counter() - started, 3)})
    if as_json:
        emit_json({"results": results})
        return
    for result in results:
        prefix = f"{result['file']}: " if len(results) > 1 else ""
        if not timestamps:
            click.echo(prefix + result["text"])
            continue
        for segment in (s for window in result["windows"] for s in window["segments"]):
            click.echo(f"{prefix}[{segment['start']:.2f} --> {segment['end']:.2f}] {segment['text']}")
