"""Prompt-lookup speculative decoding on real exports: drafts, verification in one prefill call, unchanged
greedy output, a stream with stops, a request ending inside an accepted run. Request refusals and the same
behaviours in more shapes run on the fake backend (tests/runtime/test_fake_engine.py, tests/runtime/test_fake_scheduler.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.controls.speculate import prompt_lookup  # noqa: E402

# Prompts that repeat themselves, so that drafts exist from the first step; different lengths.
PROMPTS = [
    [1, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70],
    [1, 7, 8, 9, 7, 8, 9, 7, 8],
    [1, 300, 301, 302, 5, 6, 300, 301],
]


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    # Tail [1, 2] (the 3-gram [4, 1, 2] never occurred before): its match at 0 is followed by 3, 4, 1.
    assert prompt_lookup(np.array([1, 2, 3, 4, 1, 2]), 3).tolist() == [3, 4, 1]
    # The most recent of two matches of [5] wins, and the draft stops at the end of the context.
    assert prompt_lookup(np.array([5, 8, 5, 9, 5]), 4).tolist() == [9, 5]
    # A 3-gram match beats a more recent 1-gram match.
    assert prompt_lookup(np.array([1, 2, 3, 7, 3, 0, 1, 2, 3]), 2).tolist() == [7, 3]
    assert prompt_lookup(np.array([1, 2, 3]), 4).tolist() == []
    assert prompt_lookup(np.array([4]), 4).tolist() == []


def test_speculative_greedy_equals_plain_greedy_one_row(exported) -> None:
    # The ort target (GroupQueryAttention) verifies one row per call.
    generator = Generator(exported("llama-tiny", "ort"))
    for prompt in PROMPTS:
        plain = generator.generate([prompt], max_new_tokens=40, ignore_eos=True)
        fast = generator.generate([prompt], max_new_tokens=40, ignore_eos=True, speculate="prompt-lookup")
        assert fast.tokens == plain.tokens
        assert fast.draft_tokens > 0
        # Every step gives one token plus the drafts it accepted.
        assert fast.steps == 39 - fast.accepted_tokens
    with pytest.raises(InputError, match="verifies drafts for at most 1 row.s. per call .* export with --target onnx"):
        generator.generate(PROMPTS, speculate="prompt-lookup")


def test_speculative_greedy_equals_plain_greedy_batch(exported) -> None:
    generator = Generator(exported("llama-tiny", "onnx"))
    plain = generator.generate(PROMPTS, max_new_tokens=40, ignore_eos=True)
    runs_before = generator.runs
    fast = generator.generate(PROMPTS, max_new_tokens=40, ignore_eos=True, speculate="prompt-lookup", draft_len=5)
    assert fast.tokens == plain.tokens
    assert fast.finish_reason == plain.finish_reason == ["length"] * 3
    # Drafts were really checked, and accepted drafts saved graph runs.
    assert fast.draft_tokens > 0
    runs = {phase: generator.runs[phase] - runs_before[phase] for phase in ("prefill", "decode")}
    assert runs["prefill"] + runs["decode"] == 1 + fast.steps
    assert runs["prefill"] > 1


def test_speculative_stream_and_stops(exported) -> None:
    generator = Generator(exported("llama-tiny", "onnx"))
    plain = generator.generate(PROMPTS, max_new_tokens=25, ignore_eos=True)
    # A stop token taken from the middle of a row's output ends that row there, drafts or not.
    stop = plain.tokens[0][10]
    expected = generator.generate(PROMPTS, max_new_tokens=25, ignore_eos=True, stop_token_ids=[stop])
    stream = generator.stream(PROMPTS, max_new_tokens=25, ignore_eos=True, stop_token_ids=[stop],
                              speculate="prompt-lookup", draft_len=7)
    streamed: list[list[int]] = [[] for _ in PROMPTS]
    for event in stream:
        for b, token in enumerate(event.token_ids):
            if token is not None:
                streamed[b].append(token)
    assert streamed == stream.result.tokens == expected.tokens
    assert stream.result.finish_reason == expected.finish_reason


def test_cli_generate_speculate_json(exported, tmp_path) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    folder = exported("llama-tiny", "ort")
    ids = ",".join(str(t) for t in PROMPTS[1])
    args = [
        "generate", str(folder), "--prompt-ids", ids, "--max-new-tokens", "20", "--ignore-eos", "--greedy", "--json",
    ]
    plain = json.loads(CliRunner().invoke(main, args).output)
    result = CliRunner().invoke(main, [*args, "--speculate", "prompt-lookup", "--draft-len", "4"])
    assert result.exit_code == 0, result.output
    fast = json.loads(result.output)
    assert fast["tokens"] == plain["tokens"]
    assert fast["speculation"]["method"] == "prompt-lookup"
    assert fast["speculation"]["draft_tokens"] > 0
    assert 0.0 <= fast["speculation"]["acceptance_rate"] <= 1.0
    bad = CliRunner().invoke(main, [*args, "--speculate", "prompt-lookup", "--draft-len", "99"])
    assert bad.exit_code == 2
    assert bad.output == "kvforge: error: --draft-len must be an integer in 1..15, got 99\n"


# -- serving: the Scheduler speculates for a lone request, decodes it in the batch beside others ----
def _scheduled(prompt: list[int], n: int, **options):
    from kvforge.runtime import GenerationRequest
    from kvforge.runtime.controls.sampling import SamplingConfig

    return GenerationRequest(prompt, n, SamplingConfig(greedy=True), ignore_eos=True, **options)


def test_scheduler_speculation_alone_and_beside_other_requests(exported) -> None:
    from kvforge.runtime import Speculation
    from kvforge.runtime.drivers.scheduler import Delta, Scheduler

    generator = Generator(exported("llama-tiny", "ort"))
    plain = {i: generator.generate([p], max_new_tokens=40, ignore_eos=True).tokens[0] for i, p in enumerate(PROMPTS)}
    spec = Speculation("prompt-lookup", 4)
    scheduler = Scheduler(generator, max_batch=3, max_seq_len=128, prefill_chunk=8).start()
    try:
        for i, prompt in enumerate(PROMPTS):  # alone: every step verifies a draft where there is one
            assert scheduler.submit(_scheduled(prompt, 40, speculation=spec)).result()[0] == plain[i]
        alone = scheduler.snapshot()
        assert 0 < alone["accepted_tokens"] <= alone["draft_tokens"]
        assert alone["decode_steps"] == 3 * 39 - alone["accepted_tokens"]  # each accepted token saved a step
        # A stop token inside an accepted run ends the request there, as plain decoding does.
        stop = plain[0][25]
        want = plain[0][: plain[0].index(stop) + 1]
        got, _, done = scheduler.submit(_scheduled(PROMPTS[0], 40, speculation=spec,
                                                   stop_token_ids=[stop])).result()
        assert got == want and done.finish_reason == "stop"
        # Beside other requests: others join while the speculative one runs, and it joins a running batch.
        first = scheduler.submit(_scheduled(PROMPTS[0], 40, speculation=spec))
        late, deltas = [], 0
        for event in first:
            deltas += isinstance(event, Delta)
            if deltas > 3 and not late:
                late = [scheduler.submit(_scheduled(PROMPTS[1], 40)),
                        scheduler.submit(_scheduled(PROMPTS[2], 40, speculation=spec))]
        assert first.result()[0] == plain[0]
        assert [h.result()[0] for h in late] == [plain[1], plain[2]]
    finally:
        scheduler.close()


def test_server_speculate_extension(chat_export) -> None:
    openai = pytest.importorskip("openai")
    from serving import serving

    from kvforge.serve.app import create_app

    app = create_app(chat_export, max_batch=2, max_seq_len=256, model_name="tiny", prefill_chunk=16)
    prompt = "a b c a b c a b c a b c a b"
    with serving(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        want = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        fast = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"speculate": {"method": "prompt-lookup", "draft_len": 5}})
        assert fast.choices[0].text == want
        messages = [{"role": "user", "content": prompt}]
        want = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        fast = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True,
                                              temperature=0, extra_body={"speculate": {"method": "prompt-lookup"}})
        assert "".join(c.choices[0].delta.content or "" for c in fast) == want.choices[0].message.content
        assert app.state.scheduler.snapshot()["draft_tokens"] > 0
        # Sampling speculates too (the rejection rule keeps the target's distribution): a seed repeats its text.
        sampled = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=7,
                                             extra_body={"speculate": {"method": "prompt-lookup"}}).choices[0].text
                   for _ in range(2)]
        assert sampled[0] == sampled[1]
        for extra, message in (
                ({"extra_body": {"speculate": {"method": "medusa"}}}, "unknown speculation method 'medusa'"),
                ({"extra_body": {"speculate": {"method": "prompt-lookup", "draft_len": 99}}}, "draft_len must be"),
                ({"extra_body": {"speculate": "prompt-lookup"}}, "'speculate' must be an object")):
            extra.setdefault("extra_body", {"speculate": {"method": "prompt-lookup"}})
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=4, **extra)


def _always_zero_export(hf_folder, tmp_path):
    """llama-tiny with every weight zero: all logits tie, greedy picks token 0 at every step, so every
    prompt-lookup draft of zeros is accepted whole (runs of several tokens in each verification)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.exporter.export import export_model

    folder = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "zero")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    model.save_pretrained(folder)
    export_model(folder, tmp_path / "export")
    return tmp_path / "export"


def test_scheduler_speculation_ending_inside_an_accepted_run_keeps_every_token(hf_folder, tmp_path) -> None:
    """A request that reaches max_new_tokens (or a stop) inside a verification step that accepted several
    tokens gets them all, its count matches them, and the requests queued behind it are unharmed."""
    from kvforge.runtime import Speculation
    from kvforge.runtime.drivers.scheduler import Scheduler

    generator = Generator(_always_zero_export(hf_folder, tmp_path))
    prompt = [1, 0, 0, 0]
    assert generator.generate([prompt], max_new_tokens=8, ignore_eos=True).tokens[0] == [0] * 8
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=128, prefill_chunk=8).start()
    try:
        for n in range(2, 20):
            fast = scheduler.submit(_scheduled(prompt, n, speculation=Speculation("prompt-lookup", 6)))
            queued = [scheduler.submit(_scheduled([1, 5, 6], 3)) for _ in range(3)]
            tokens, _, done = fast.result()
            assert (tokens, done.completion_tokens, done.finish_reason) == ([0] * n, n, "length"), n
            for handle in queued:
                got, _, after = handle.result()
                assert (got, after.error, after.finish_reason) == ([0] * 3, None, "length"), n
        # More accepted draft tokens than requests: verification steps accepted runs of several tokens.
        assert scheduler.snapshot()["accepted_tokens"] > 2 * len(range(2, 20))
    finally:
        scheduler.close()
