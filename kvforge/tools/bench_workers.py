"""`kvforge bench`'s worker processes (kvforge/tools/bench.py runs them): each system's timed generation
in a process of its own, so that its peak RSS is its own, and each system's cold start.

Worker mode (what each process runs): python -m kvforge.tools.bench_workers worker SYSTEM PATH PROMPT_LEN NEW
BATCH THREADS SPIN [DRAFT_LEN] (SPIN: 1, or 0 for kvforge's --no-spin); a peer's cold start: python -m
kvforge.tools.bench_workers cold SYSTEM PATH PROMPT THREADS (PROMPT: text, or ids as 1,2,3)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError


def check_fits(manifest: dict[str, Any], prompt_len: int, new_tokens: int) -> None:
    """Refuse, before any run, a prompt and its new tokens that the export's KV capacity cannot hold."""
    from kvforge.core.contract import KVLayout

    capacity = KVLayout.from_manifest(manifest).max_capacity
    if prompt_len + new_tokens > capacity:
        raise InputError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} is over the export's "
                         f"{capacity} positions (the model's context length); use fewer")


def row_lengths(prompt_len: int, batch: int) -> list[int]:
    """The prompt length of each batch row: prompt_len, then 3 fewer a row (rows of different lengths), or
    fewer steps where prompt_len is short for the batch, so that every row keeps at least one token."""
    step = min(3, (prompt_len - 1) // (batch - 1)) if batch > 1 else 0
    return [prompt_len - step * b for b in range(batch)]


# `kvforge bench --prompt-file`: the prompt's token ids (the export's tokenizer), which every worker reads from
# the file this variable names, so that all systems get the same ids.
PROMPT_IDS_ENV = "KVFORGE_BENCH_PROMPT_IDS"


def prompt_ids(length: int, row: int = 0, vocab: int = 512) -> list[int]:
    """A fixed, repeatable prompt of token ids every system gets (a different one per batch row): the first
    `length` ids of --prompt-file's text when one was given, else ids in an arithmetic progression."""
    given = os.environ.get(PROMPT_IDS_ENV)
    if given:
        return json.loads(Path(given).read_text())[:length]
    return [((7 + 2 * row) * i + 3 * row) % (vocab - 10) + 5 for i in range(length)]


# The warm-up generation (sessions, thread pools, arenas) uses at most this much of the prompt: a long
# prompt's prefill (minutes at 8k positions on 2 cores) is paid once, in the timed run, whose decode
# tokens/s excludes it. kvforge's timed run then allocates its cache bucket inside its TTFT.
WARMUP_PROMPT = 256


def _warmup(rows: list[list[int]]) -> list[list[int]]:
    return [row[:WARMUP_PROMPT] for row in rows]


def _peak_rss_mb() -> float:
    # VmHWM is this process image's own peak: ru_maxrss survives execve on Linux, so a worker would
    # report its parent's peak whenever that was larger.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- workers (one process each) ---------------------------------------------------------------------
def _work_kvforge(path: str, prompt_len: int, new: int, batch: int, threads: int, spinning: bool = True,
                  draft_len: str = "0", method: str = "prompt-lookup", draft: str = "-") -> dict[str, Any]:
    """kvforge's greedy decode; with `draft_len`, speculation by `method` (`draft`: the export at `draft`),
    its drafts verified in one prefill call per step. The tokens go back too, so the two modes can be checked
    for equality."""
    from kvforge.runtime import GenerationRequest, Generator, Speculation
    from kvforge.tools.speculation import target_options

    draft_len = int(draft_len)
    # As the command line loads a target: a speculating one's threads sleep between runs unless told otherwise
    loading = target_options(path, None, method if draft_len else None, {} if spinning else {"spinning": False})
    gen = Generator(path, threads=threads, draft=None if draft == "-" else draft, **loading)
    prompts = [prompt_ids(n, b, gen.vocab_size) for b, n in enumerate(row_lengths(prompt_len, batch))]
    speculation = Speculation(method, draft_len) if draft_len else None
    request = GenerationRequest(prompts, new, ignore_eos=True, speculation=speculation)  # greedy
    gen.generate(request.replace(prompts=_warmup(prompts), max_new_tokens=8))  # warm-up
    start = time.perf_counter()
    result = gen.generate(request)
    total_s = time.perf_counter() - start
    steps = result.steps
    out: dict[str, Any] = {"ttft_ms": result.ttft_ms, "decode_tokens_per_s": result.decode_tokens_per_s,
                           "step_ms": result.decode_ms / max(steps, 1),
                           "end_to_end_tokens_per_s": sum(map(len, result.tokens)) / total_s,
                           "tokens": result.tokens}
    if draft_len:
        out.update(steps=steps, draft_tokens=result.draft_tokens, accepted_tokens=result.accepted_tokens,
                   verify_steps=result.verify_steps, drafted_at=result.drafted_at, accepted_at=result.accepted_at,
                   tokens_per_step=result.tokens_per_step)
    return out


def _work_hf(path: str, prompt_len: int, new: int, batch: int, threads: int, spinning: bool = True) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    full = [prompt_ids(n, b, vocab) for b, n in enumerate(row_lengths(prompt_len, batch))]

    def run(tokens: int, rows: list[list[int]]) -> tuple[float, float]:
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding, as HF generate wants
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            start = time.perf_counter()
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            first = time.perf_counter()
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            step_mask = mask
            for _ in range(tokens - 1):
                step_mask = torch.cat([step_mask, torch.ones(batch, 1, dtype=mask.dtype)], 1)
                out = model(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            end = time.perf_counter()
        return (first - start) * 1e3, batch * (tokens - 1) / (end - first)

    run(8, _warmup(full))
    ttft, tps = run(new, full)
    return {"ttft_ms": ttft, "decode_tokens_per_s": tps, "step_ms": 1e3 * batch / tps}


def _work_genai(path: str, prompt_len: int, new: int, batch: int, threads: int, spinning: bool = True) -> dict[str, float]:
    # `spinning` is kvforge's: genai_config.json's session_options take no ORT config entries, so
    # onnxruntime-genai always runs with ONNX Runtime's default (spinning threads).
    import onnxruntime_genai as og

    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    genai_config = json.loads((Path(path) / "genai_config.json").read_text())["model"]
    vocab, pad = genai_config["vocab_size"], int(genai_config.get("pad_token_id") or 0)
    full = [prompt_ids(n, b, vocab) for b, n in enumerate(row_lengths(prompt_len, batch))]

    def run(tokens: int, rows: list[list[int]]) -> tuple[float, float]:
        params = og.GeneratorParams(model)
        width = max(map(len, rows))
        params.set_search_options(max_length=width + tokens, min_length=width + tokens, do_sample=False,
                                  batch_size=batch)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        if batch == 1:
            generator.append_tokens(rows[0])
        else:  # a batch goes in as one 2-D array: rows left-padded with the model's pad id
            import numpy as np

            generator.append_tokens(np.array([[pad] * (width - len(r)) + r for r in rows], dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        count = 1
        while not generator.is_done():
            generator.generate_next_token()
            count += 1
        end = time.perf_counter()
        return (first - start) * 1e3, batch * (count - 1) / (end - first)

    run(8, _warmup(full))
    ttft, tps = run(new, full)
    return {"ttft_ms": ttft, "decode_tokens_per_s": tps, "step_ms": 1e3 * batch / tps}


# -- cold start: one whole process, start to first token ---------------------------------------------
COLD_PROMPT = "What is the capital of France?"


def _cold_genai(path: str, prompt: str, threads: int) -> str:
    import onnxruntime_genai as og

    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    ids = _cold_ids(prompt) or list(tokenizer.encode(prompt))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()
    return tokenizer.decode(generator.get_sequence(0)[-1:])


def _cold_hf(path: str, prompt: str, threads: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _cold_ids(prompt) or tokenizer.encode(prompt)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=1, do_sample=False)
    return tokenizer.decode(out[0, len(ids):])


def _cold_ids(prompt: str) -> list[int] | None:
    """The prompt's token ids when it is given as ids ("1,2,3"), else None (a text)."""
    return [int(i) for i in prompt.split(",")] if prompt.replace(",", "").isdigit() else None


COLD: dict[str, Callable[[str, str, int], str]] = {"ort-genai": _cold_genai, "hf": _cold_hf}


def cold_start_command(system: str, path: str, prompt: str, threads: int) -> list[str]:
    """The process whose run time is `system`'s cold start: kvforge's own CLI, a peer's cold worker."""
    if system == "kvforge":
        given = ["--prompt-ids", prompt] if _cold_ids(prompt) else ["--prompt", prompt]
        return [sys.executable, "-m", "kvforge.cli", "generate", path, *given, "--max-new-tokens", "1", "--greedy",
                "--threads", str(threads)]
    return [sys.executable, "-m", "kvforge.tools.bench_workers", "cold", system, path, prompt, str(threads)]


def cold_start_ms(system: str, path: str, prompt: str, threads: int) -> float:
    """Milliseconds from spawning `system`'s cold-start process to its exit (it prints one token)."""
    command = cold_start_command(system, path, prompt, threads)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    elapsed = (time.perf_counter() - start) * 1e3
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"the {system} cold-start process failed: {tail}")
    return elapsed


SPECULATIVE = "kvforge+speculative"  # kvforge with speculative decoding (--speculate METHOD)
WORKERS: dict[str, Callable[..., dict[str, Any]]] = {"kvforge": _work_kvforge, SPECULATIVE: _work_kvforge,
                                                     "hf": _work_hf, "ort-genai": _work_genai}


def _worker_main(argv: list[str]) -> None:
    system, path, prompt_len, new, batch, threads, spin, *extra = argv
    result = WORKERS[system](path, int(prompt_len), int(new), int(batch), int(threads), spin == "1", *extra)
    result["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        _worker_main(sys.argv[2:])
    elif len(sys.argv) == 6 and sys.argv[1] == "cold":
        print(COLD[sys.argv[2]](sys.argv[3], sys.argv[4], int(sys.argv[5])))
