"""Soak of `kvforge serve` speculating (issue 54), beside benchmarks/soak_server.py, whose load it reuses.

    OMP_NUM_THREADS=1 python benchmarks/soak_speculation.py --requests 2000 --clients 64

The target is the tiny random-weight llama-tiny recipe with a chat template, exported fp32 for ort-cpu; its int4
export is the draft. The server runs with `--speculate draft --draft INT4 --draft-len 4` (adaptive), so a request
without "speculate" drafts with the int4 export. The good requests, completions and chats, each in one of five
ways: "speculate" absent (the server's default: draft), false or {"method": "off"} (opted out: plain decoding),
{"method": "draft", "draft_len": 3}, {"method": "prompt-lookup", "draft_len": 6}; half of the prompts repeat a
phrase (prompt lookup finds drafts, the draft export is often right). Greedy ones (temperature 0) must equal
their solo answer, computed first with the Generator without speculation: the target is fp32 (ONNX Runtime's
MatMul gives a row the same bits alone or in a batch, so no near-tie can tip; see soak_server.NEAR_TIE), and
greedy speculation keeps exactly the target's argmax. Seeded sampled ones (temperature 0.8, top_p 0.95, a seed)
sent again give the same answer (streamed or not, under any batch; the first answer under load is the reference)
where nothing int4 takes part: opted out, or prompt lookup (a failure otherwise). Drafted by the int4 export
(default, draft), they are counted, not failed: ONNX Runtime's MatMulNBits is not batch-invariant (a row's draft
logits differ by ~4e-6 alone and in a batch of three), so the draft's probabilities q, hence its samples, the
acceptance tests u < p/q and the residual max(0, p - q) (small where the draft agrees with the target, so the
noise weighs much more in it), can tip with the batch the row shares. Sampled answers are not compared with a
solo answer either: speculation draws the row's random numbers for the draft's samples and the acceptance
tests, so a sampled speculative answer is another draw from the same distribution than the plain one (the
figures say how many happened to match anyway).
soak_server.soak sends the mix: good requests, streamed or not, bad ones (soak_server.BAD and bad "speculate"
values: 4xx JSON errors), streams cancelled after two chunks, clients that give up after 50 ms; /health probed
every 0.2 s (under 2 s), the server's RSS flat (within 50 MB). The server's request log (--log-format json)
must show the drafts of speculative requests: draft_tokens, accepted_tokens, verify_steps per request, from
the scheduler's Done of each choice. Prints the figures and PASS/FAIL (exit 0 when passed).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_server  # noqa: E402
from soak_server import BAD, JSON, LATE_PROMPT, build_export, chat_source, late_failing_grammar  # noqa: E402

# How each good request speculates: its "speculate" value (None: the field is absent, the server's default).
WAYS: dict[str, Any] = {"default": None, "off": False, "off object": {"method": "off"},
                        "draft": {"method": "draft", "draft_len": 3},
                        "prompt-lookup": {"method": "prompt-lookup", "draft_len": 6}}
INT4_DRAFTED = ("default", "draft")  # the ways whose drafts come from the int4 export
SERVE = ("--speculate", "draft", "--draft-len", "4", "--log-format", "json")
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
SPEC_BAD: list[tuple[str, str, bytes, Any]] = [
    ("speculate medusa", "/v1/completions", b'{"prompt": "x", "speculate": {"method": "medusa"}}', JSON),
    ("speculate eagle, no head", "/v1/completions", b'{"prompt": "x", "speculate": {"method": "eagle"}}', JSON),
    ("speculate draft_len 0", "/v1/completions",
     b'{"prompt": "x", "speculate": {"method": "draft", "draft_len": 0}}', JSON),
    ("speculate a string", "/v1/completions", b'{"prompt": "x", "speculate": "draft"}', JSON),
    ("speculate key", "/v1/completions", b'{"prompt": "x", "speculate": {"method": "draft", "zzz": 1}}', JSON),
]


def build(root: Path) -> tuple[Path, Path]:
    """The fp32 target export (with the chat template) and its int4 export, the draft."""
    from kvforge.exporter.export import export_model

    target = build_export(root)
    export_model(chat_source(root), root / "draft-int4", quantize="int4")
    return target, root / "draft-int4"


def speculation_jobs(export: Path, seed: int, per_way: int = 6) -> list[dict[str, Any]]:
    """Good requests in every way of WAYS: greedy completions and chats with their solo answers, and seeded
    sampled completions checked by repetition (their solo plain answer kept for the figures)."""
    from kvforge.runtime import Generator

    generator = Generator(export)
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog once upon time there was king who loved".split()
    lock = threading.Lock()
    jobs = []
    for way, speculate in WAYS.items():
        extra = {} if speculate is None else {"speculate": speculate}
        for i in range(per_way):
            phrase = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            prompt = ", ".join([phrase] * 3) if i % 2 == 0 else phrase + f" {i}"  # repeats: drafts get accepted
            max_tokens = rng.randint(4, 32)
            want = generator.generate(prompt, max_new_tokens=max_tokens, greedy=True).text[0]
            jobs.append({"kind": "text", "tag": f" greedy {way}", "want": want,
                         "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}})
        for _ in range(2):
            messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))}]
            max_tokens = rng.randint(4, 24)
            want = generator.chat(messages, max_new_tokens=max_tokens, greedy=True).text[0]
            jobs.append({"kind": "chat", "tag": f" greedy chat {way}", "want": want,
                         "body": {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}})
        for i in range(per_way // 2):
            phrase = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
            prompt, max_tokens, sample_seed = ", ".join([phrase] * (3 if i % 2 == 0 else 1)), 24, rng.randint(0, 9999)
            solo = generator.generate(prompt, max_new_tokens=max_tokens, seed=sample_seed, **SAMPLING).text[0]
            job = {"kind": "text", "tag": f" sampled {way}", "solo": solo, "answers": [],
                   "body": {"prompt": prompt, "max_tokens": max_tokens, "seed": sample_seed, **SAMPLING, **extra}}
            job["check"] = repeats(job, lock, strict=way not in INT4_DRAFTED)
            jobs.append(job)
    return jobs


def repeats(job: dict[str, Any], lock: threading.Lock, strict: bool) -> Any:
    """A sampled job's check: every answer equals the first one (seeded: the same request, the same answer);
    not `strict`: another answer is counted in job["other"], not failed (the int4 draft's, see the docstring)."""
    def check(got: str) -> str | None:
        with lock:
            job["answers"].append(got)
            first = job["answers"][0]
            job["other"] = job.get("other", 0) + (got != first)
        return None if got == first or not strict else f"{job['body']} -> {got!r}, first {first!r}"
    return check


def request_log(lines: list[str]) -> list[dict[str, Any]]:
    """The server's JSON request-log lines of answered requests."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("status") == 200:
            out.append(record)
    return out


def soak_speculation(workdir: Path, args: argparse.Namespace) -> int:
    """Build the target and its draft, compute the solo answers, soak the speculating server: 0 when it passed."""
    from kvforge.runtime import Generator

    start = time.monotonic()
    target, draft = build(workdir)
    jobs = speculation_jobs(target, args.seed)
    late = json.dumps({"prompt": LATE_PROMPT, "max_tokens": 24, "temperature": 0, "response_format": {
        "type": "lark", "grammar": late_failing_grammar(Generator(target), LATE_PROMPT)}}).encode()
    bad = [*BAD, *SPEC_BAD, ("grammar failing while generating", "/v1/completions", late, JSON)]
    print(f"== speculation: target {target}, draft {draft}; {len(jobs)} good requests' solo answers computed in "
          f"{time.monotonic() - start:.1f} s; {len(bad)} kinds of bad request", flush=True)
    log: list[str] = []
    code = soak_server.soak(target, jobs, bad, args, serve_args=(*SERVE, "--draft", str(draft)), log=log)
    return code if summarize(jobs, request_log(log)) else 1


def summarize(jobs: list[dict[str, Any]], lines: list[dict[str, Any]]) -> bool:
    """Print the sampled jobs' and the request log's figures; False where the log lacks the drafts."""
    sampled = [job for job in jobs if "answers" in job]

    def per_way(count: Any) -> str:  # "way n/answers" for each way of WAYS
        ways = {way: [job for job in sampled if job["tag"] == f" sampled {way}"] for way in WAYS}
        return ", ".join(f"{way} {sum(map(count, group))}/{sum(len(job['answers']) for job in group)}"
                         for way, group in ways.items())

    print(f"seeded sampled requests: {len(sampled)}, {sum(len(job['answers']) >= 2 for job in sampled)} answered "
          f"twice or more; answers other than the request's first: {per_way(lambda job: job.get('other', 0))}; "
          f"equal to the solo plain answer: {per_way(lambda job: job['answers'].count(job['solo']))}")
    drafted = [line for line in lines if line.get("draft_tokens")]
    by_way = {line.get("speculate") for line in drafted}
    plain = [line for line in lines if line.get("speculate") is None]
    print(f"request log: {len(lines)} answered requests, {len(drafted)} with drafts (methods {sorted(by_way)}): "
          f"{sum(line['draft_tokens'] for line in drafted)} drafted, "
          f"{sum(line['accepted_tokens'] for line in drafted)} accepted in "
          f"{sum(line.get('verify_steps', 0) for line in drafted)} verifications; "
          f"{len(plain)} plain, none with drafts: {not any(line.get('draft_tokens') for line in plain)}")
    ok = by_way == {"draft", "prompt-lookup"} and not any(line.get("draft_tokens") for line in plain)
    if not ok:
        print("FAIL: the request log does not show each speculative request's drafts (and none for plain ones)")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvforge-soak-spec-"))
    try:
        code = soak_speculation(workdir, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("speculation: " + ("PASS" if code == 0 else "FAIL"))
    return code


if __name__ == "__main__":
    sys.exit(main())
