"""Speculative decoding on the command line and over HTTP (kvforge/cli/speculation.py, kvforge/tools/speculation.py,
kvforge/serve/speculation.py): `generate` and `chat` with --speculate / --draft / --draft-len give greedy decoding's
tokens and report the drafts in --json; `serve --speculate` is every request's default, which a request overrides
or turns off; sampled speculative requests repeat with a seed; /metrics and the request log show the counters;
bad input is one line, exit 2 (or a 400), before anything runs."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from kvforge.cli import main  # noqa: E402

# A prompt that repeats itself: prompt lookup has drafts from the first step.
PROMPT_IDS = "1,50,60,70,80,50,60,70"
TEXT = "a b c a b c a b c a b c a b"


@pytest.fixture(scope="module")
def target(exported):
    return exported("llama-tiny", "ort")


@pytest.fixture(scope="module")
def draft(draft_export):
    """llama-tiny's int4 export (conftest's draft_export, made once per run): self-speculation by quantisation."""
    return draft_export("ort")


@pytest.fixture(scope="module")
def chat_draft(chat_export, tmp_path_factory):
    """The chat export's int4 twin (same tokenizer and template): a draft for the server and chat tests."""
    from kvforge.exporter.export import export_model

    out = tmp_path_factory.mktemp("spec-chat-draft") / "int4"
    export_model(chat_export.parent / "model", out, quantize="int4")
    return out


def run(*args: str, stdin: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=stdin)


def generate_json(*args: str) -> dict:
    result = run("generate", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_cli_mirrors_the_runtimes_constants() -> None:
    from kvforge.cli import speculation as cli
    from kvforge.runtime.controls import speculate

    assert (cli.METHODS, cli.DEFAULT_DRAFT_LEN, cli.MAX_DRAFT_LEN) == \
        (speculate.METHODS, speculate.DEFAULT_DRAFT_LEN, speculate.MAX_DRAFT_LEN)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft"])
def test_generate_speculates_with_greedys_tokens_and_reports_the_drafts(target, draft, method) -> None:
    common = (target, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "24", "--greedy", "--ignore-eos")
    plain = generate_json(*common)
    extra = ("--draft", draft) if method == "draft" else ()
    fast = generate_json(*common, "--speculate", method, "--draft-len", "4", *extra)
    assert fast["tokens"] == plain["tokens"]
    spec = fast["speculation"]
    assert spec["method"] == method and spec["draft_len"] == 4
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == round(spec["accepted_tokens"] / spec["draft_tokens"], 4)
    # Per draft position: every verification drafts position 1; no more positions than --draft-len.
    assert 1 <= len(spec["drafted_at"]) <= 4 and spec["drafted_at"][0] == spec["verify_steps"]
    assert sum(spec["drafted_at"]) == spec["draft_tokens"] and sum(spec["accepted_at"]) == spec["accepted_tokens"]
    assert spec["acceptance_by_position"] == [round(a / d, 4) for d, a in
                                          zip(spec["drafted_at"], spec["accepted_at"], strict=True)]
    # 24 tokens: the first from the prefill, then one per step plus the drafts each step kept.
    assert fast["steps"] == 23 - spec["accepted_tokens"]
    assert spec["tokens_per_step"] == round(24 / fast["steps"], 4)
    assert "speculation" not in plain


def test_generate_samples_with_speculation(target, draft) -> None:
    args = (target, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "11",
            "--speculate", "draft", "--draft", draft)
    first, second = generate_json(*args), generate_json(*args)
    assert first["tokens"] == second["tokens"] and len(first["tokens"][0]) == 16
    assert first["speculation"]["draft_tokens"] > 0
    text = run("generate", *args)
    assert text.exit_code == 0, text.output
    assert "drafted tokens accepted (draft)" in text.stderr and "tokens per step" in text.stderr


def _renamed_vocabulary(draft, tmp_path):
    """A copy of `draft` whose tokenizer renames one token: same size, other ids."""
    other = tmp_path / "renamed"
    shutil.copytree(draft, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(token for token in vocab if vocab[token] == 5)
    vocab[first + "x"] = vocab.pop(first)
    data = json.dumps(tokenizer).encode()
    (other / "tokenizer.json").write_bytes(data)
    manifest = json.loads((other / "kvforge.json").read_text())  # re-listed, as an export of that tokenizer would be
    manifest["files"]["tokenizer.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (other / "kvforge.json").write_text(json.dumps(manifest))
    return other


def test_generate_refuses_bad_speculation_in_one_line(target, draft, exported, tmp_path) -> None:
    base = (target, "--prompt-ids", "1,5,6")
    cases = [
        (("--speculate", "draft"), r"--speculate draft needs --draft DIR"),
        (("--draft", draft), r"--draft DIR goes with --speculate draft$"),
        (("--speculate", "prompt-lookup", "--draft", draft), r"--draft DIR goes with --speculate draft, not "
                                                             r"prompt-lookup$"),
        (("--draft-len", "3"), r"--draft-len goes with --speculate, which is not given"),
        (("--speculate", "prompt-lookup", "--draft-len", "16"), r"--draft-len must be an integer in 1\.\.15, got 16$"),
        (("--speculate", "eagle"), r"--speculate eagle: this export carries no EAGLE-3 head; export with --eagle "
                                   r"HEAD_DIR"),
        (("--speculate", "mtp"), r"--speculate mtp: this export carries no MTP layer; export a checkpoint that "
                                 r"ships one"),
        (("--speculate", "draft", "--draft", tmp_path), r"--draft .*: not a kvforge export folder \(no "
                                                        r"kvforge\.json\)"),
        (("--speculate", "draft", "--draft", target), r"--draft .* is the target export itself"),
        (("--speculate", "draft", "--draft", _renamed_vocabulary(draft, tmp_path)),
         r"--draft .*: its vocabulary differs from the target's \(2 token/id pairs"),
        # Another target type: the draft runs on the target's backend (ort-cpu), which runs no trt export.
        (("--speculate", "draft", "--draft", exported("llama-tiny", "trt")),
         r"--draft .*: backend 'ort-cpu' does not run trt-target exports.*export it with --target ort, as the "
         r"target was\)$"),
    ]
    for args, message in cases:
        result = run("generate", *base, *args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert re.search(message, lines[0].removeprefix("kvforge: error: ")), (args, lines[0])
    assert result.stdout == ""


def test_chat_speculates_and_reports_each_turn(chat_export, chat_draft) -> None:
    stdin = f"{TEXT}\nhello there\n"
    common = (chat_export, "--max-new-tokens", "12", "--greedy", "--json")
    plain = run("chat", *common, stdin=stdin)
    fast = run("chat", *common, "--speculate", "draft", "--draft", chat_draft, "--draft-len", "4", stdin=stdin)
    assert plain.exit_code == 0 and fast.exit_code == 0, (plain.output, fast.output)
    plain_turns = [json.loads(line) for line in plain.stdout.splitlines()]
    fast_turns = [json.loads(line) for line in fast.stdout.splitlines()]
    assert [t["answer"] for t in fast_turns] == [t["answer"] for t in plain_turns] and len(fast_turns) == 2
    for turn in fast_turns:
        spec = turn["speculation"]
        assert spec["method"] == "draft" and spec["draft_tokens"] > 0 and spec["verify_steps"] > 0
        assert sum(spec["drafted_at"]) == spec["draft_tokens"] and spec["tokens_per_step"] >= 1.0
    assert "speculation" not in plain_turns[0]
    bad = run("chat", chat_export, "--speculate", "mtp", stdin="hi\n")
    assert bad.exit_code == 2 and "--speculate mtp: this export carries no MTP layer" in bad.stderr


def test_serve_flags_are_checked_before_loading(chat_export, tmp_path) -> None:
    for args, message in ((("--speculate", "draft"), "--speculate draft needs --draft DIR"),
                          (("--draft-len", "0"), "--draft-len must be an integer in 1..15, got 0"),
                          (("--speculate", "eagle"), "--speculate eagle: this export carries no EAGLE-3 head"),
                          (("--draft", tmp_path), "not a kvforge export folder")):
        result = run("serve", chat_export, "--port", "0", *args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and "serving" not in result.stderr


def test_server_default_override_opt_out_sampling_metrics_and_log(chat_export, chat_draft, caplog) -> None:
    from fastapi.testclient import TestClient

    from kvforge.serve.app import create_app

    caplog.set_level(logging.INFO, logger="kvforge.serve")
    app = create_app(chat_export, max_batch=2, max_seq_len=256, model_name="tiny", prefill_chunk=16,
                     speculate="draft", draft=chat_draft, draft_len=4)
    with TestClient(app) as client:
        def complete(**body):
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": TEXT, "max_tokens": 16, **body})
            return response.status_code, response.json()

        status, plain = complete(temperature=0, speculate=False)
        assert status == 200 and app.state.scheduler.snapshot()["draft_tokens"] == 0  # opted out of the default
        assert complete(temperature=0, speculate={"method": "off"})[1]["choices"] == plain["choices"]
        assert app.state.scheduler.snapshot()["draft_tokens"] == 0
        status, fast = complete(temperature=0)  # the server's default: the draft export
        assert status == 200 and fast["choices"][0]["text"] == plain["choices"][0]["text"]
        drafted = app.state.scheduler.snapshot()["draft_tokens"]
        assert drafted > 0
        status, own = complete(temperature=0, speculate={"method": "prompt-lookup", "draft_len": 3})
        assert status == 200 and own["choices"][0]["text"] == plain["choices"][0]["text"]
        sampled = [complete(temperature=0.8, seed=5)[1]["choices"][0]["text"] for _ in range(2)]
        assert sampled[0] == sampled[1]
        for body, message in (({"speculate": {"method": "eagle"}}, "'speculate' method 'eagle': this export carries "
                                                                   "no EAGLE-3 head"),
                              ({"speculate": {"method": "medusa"}}, "unknown speculation method 'medusa'"),
                              ({"speculate": {"method": "draft", "draft_len": 16}}, "draft_len must be"),
                              ({"speculate": "draft"}, "'speculate' must be an object")):
            status, error = complete(**body)
            assert status == 400 and message in error["error"]["message"], error
        metrics = client.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("kvforge_speculative")}
    snapshot = app.state.scheduler.snapshot()
    assert values["kvforge_speculative_draft_tokens_total"] == snapshot["draft_tokens"] > drafted
    assert values["kvforge_speculative_accepted_tokens_total"] == snapshot["accepted_tokens"]
    assert values["kvforge_speculative_verify_steps_total"] == snapshot["verify_steps"] > 0
    assert values["kvforge_speculative_acceptance_rate"] == pytest.approx(
        snapshot["accepted_tokens"] / snapshot["draft_tokens"])
    assert values["kvforge_speculative_tokens_per_step"] == pytest.approx(
        snapshot["speculative_tokens"] / snapshot["speculative_steps"])
    assert values['kvforge_speculative_position_drafted_tokens_total{position="1"}'] == snapshot["drafted_at"][0]
    assert values['kvforge_speculative_position_accepted_tokens_total{position="1"}'] == snapshot["accepted_at"][0]
    lines = [r.kvforge_fields for r in caplog.records if r.name == "kvforge.serve" and
             getattr(r, "kvforge_fields", {}).get("status") == 200]
    assert [line.get("speculate") for line in lines] == [None, None, "draft", "prompt-lookup", "draft", "draft"]
    # Each request's line carries its own drafts (the scheduler's Done per choice): the opted-out ones none, and
    # together they are the scheduler's totals.
    assert [("draft_tokens" in line) for line in lines[:2]] == [False, False]
    assert all(line["draft_tokens"] > 0 and 0 < line["verify_steps"] <= line["draft_tokens"] for line in lines[2:])
    for key in ("draft_tokens", "accepted_tokens", "verify_steps"):
        assert sum(line.get(key, 0) for line in lines) == snapshot[key], key
    assert lines[2]["acceptance"] == round(lines[2]["accepted_tokens"] / lines[2]["draft_tokens"], 3)


def test_the_request_log_sums_each_choices_speculation_where_the_scheduler_reports_it() -> None:
    from kvforge.cli.run import speculating
    from kvforge.runtime.controls.request import FinishReason
    from kvforge.runtime.drivers.handles import Done
    from kvforge.serve.choices import Job, Tally
    from kvforge.serve.speculation import log_fields

    tally = Tally([Job([1, 2, 3], object())], 2)  # one prompt, n=2: two choices' Done events
    for index, (drafted, accepted, steps) in enumerate(((8, 6, 3), (4, 1, 2))):
        done = Done(FinishReason.LENGTH, 3, 10, 3, 0, 5.0, index=index)
        done.draft_tokens, done.accepted_tokens, done.verify_steps = drafted, accepted, steps
        merged = tally.add(done)
    assert log_fields(merged) == {"draft_tokens": 12, "accepted_tokens": 7, "acceptance": 0.583, "verify_steps": 5}
    # A Done without the counts (a scheduler that does not report them per request): no such fields.
    assert log_fields(Done(FinishReason.LENGTH, 3, 10, 3, 0, 5.0)) == {}
    assert speculating("draft", 4, True) == ", speculating by draft (up to 4 tokens, adaptive)"
    assert speculating(None, 6, True) == ""


def test_head_methods_name_the_head_the_export_carries_and_the_backends_that_run_heads() -> None:
    from types import SimpleNamespace

    from kvforge.core.errors import InputError
    from kvforge.runtime.backends.backend import Limits
    from kvforge.tools.speculation import check_target

    def export(kind, backend="ort-cpu", rollback=True):
        limits = Limits(None, 64, (64,), rollback=rollback)
        return SimpleNamespace(manifest={"draft": {"kind": kind}} if kind else {}, backend_name=backend,
                               backend=SimpleNamespace(limits=limits, name=backend))

    check_target(export("eagle3"), "eagle")
    check_target(export("mtp"), "mtp")
    check_target(export(None), "prompt-lookup")
    for target, method, message in (
            (export("mtp"), "eagle", "--speculate eagle: this export carries no EAGLE-3 head but an MTP layer; "
                                     "speculate with method mtp"),
            (export("eagle3"), "mtp", "--speculate mtp: this export carries no MTP layer but an EAGLE-3 head; "
                                      "speculate with method eagle"),
            (export("eagle3", "emulate"), "eagle", "--speculate eagle: backend 'emulate' does not run speculation "
                                                   "heads"),
            (export(None, rollback=False), "prompt-lookup", "speculative decoding needs a cache that can drop "
                                                            "rejected drafts")):
        with pytest.raises(InputError, match="^" + re.escape(message)):
            check_target(target, method)
