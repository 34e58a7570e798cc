"""Helpers of the server tests: an app on a real uvicorn server in a thread, and exports with a chat template."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: Any, log_level: str = "warning") -> Iterator[str]:
    """`app` on a free loopback port (disconnects and streams need real sockets): its base URL,
    once /health answers."""
    import httpx
    import uvicorn

    port = free_port()
    runner = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        runner.should_exit = True
        thread.join(timeout=10)


def with_template(source: Path, out: Path, template: str) -> Path:
    """A copy of export `source` whose chat template is `template` (listed and hashed in its manifest)."""
    shutil.copytree(source, out)
    data = template.encode()
    (out / "chat_template.jinja").write_bytes(data)
    manifest = json.loads((out / "kvforge.json").read_text())
    manifest["chat_template"] = "chat_template.jinja"
    manifest["files"]["chat_template.jinja"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (out / "kvforge.json").write_text(json.dumps(manifest))
    return out


BOMB = "/a{1000}{1000}/"  # a regex whose lexer meets llguidance's limits as soon as it is entered


def late_failing_grammar(generator: Any, prompt: str) -> str:
    """A Lark grammar that passes admission and fails while `generator` (greedy) answers `prompt`: two
    branches, a safe one behind the letter with the lower token id (the admission trial walks the lowest
    ids) and BOMB behind the letter this model picks, found by asking it to pick between two letters."""
    from kvforge.runtime.controls.constraint import Grammar

    ids = {c: generator.tokenizer.encode(c, add_special_tokens=False)[0] for c in "bcdefghijklmnopqrstuvwxyz"}
    for low in ids:
        for high in ids:
            if ids[low] >= ids[high]:
                continue
            pick = generator.generate(prompt, max_new_tokens=1, greedy=True,
                                      grammar=Grammar.lark(f'start: "{low}" | "{high}"')).text[0]
            if pick == high:
                return f'start: "{low}" "{low}"* | "{high}" {BOMB}'
    raise AssertionError("the model picks the lower id of every pair of letters")


def greedy_alone(generator: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """`prompt`'s greedy answer from `generator`, alone."""
    return generator.generate([prompt], max_new_tokens=new_tokens, greedy=True, ignore_eos=True).tokens[0]


def check_two_turns(scheduler: Any, solo: Any, prompts: list[list[int]], lengths: tuple[int, ...] = (4, 9, 6)
                    ) -> list[list[int]]:
    """Serve `prompts` (max_new_tokens `lengths`) on a running Scheduler, then a second turn that continues
    prompts[1]'s whole answer: each answer must be `solo`'s greedy answer alone, and the second turn must
    take the first turn's rows from the prefix store. Returns the first turn's answers."""
    from kvforge.runtime import GenerationRequest
    from kvforge.runtime.controls.sampling import SamplingConfig

    handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True))
               for p, n in zip(prompts, lengths, strict=True)]
    served = [handle.result()[0] for handle in handles]
    assert served == [greedy_alone(solo, p, n) for p, n in zip(prompts, lengths, strict=True)]
    first = prompts[1] + served[1][:-1]
    follow = first + [served[1][-1], 9, 10]
    tokens, _, done = scheduler.submit(GenerationRequest(list(follow), 5, SamplingConfig(greedy=True),
                                                         ignore_eos=True)).result()
    assert done.cached_tokens == len(first) and tokens == greedy_alone(solo, follow, 5)
    return served


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with almost no pixel data (a decompression bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def data_url(data: bytes, kind: str = "png") -> str:
    """An image's bytes as the data: URL an OpenAI image_url part carries."""
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()
