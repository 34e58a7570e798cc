"""The CLI as a user meets it: one-line errors with non-zero exits, --json on stdout."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main

pytest.importorskip("torch")


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_generate_json_has_the_documented_fields(exported) -> None:
    code, out, _ = run("generate", str(exported("llama-tiny")), "--prompt-ids", "1,50,60", "--prompt-ids", "1,7",
                       "--max-new-tokens", "6", "--greedy", "--json")
    assert code == 0
    payload = json.loads(out)
    for key in ("tokens", "text", "prompt_tokens", "ttft_ms", "decode_tokens_per_s"):
        assert key in payload
    assert payload["prompt_tokens"] == [3, 2]
    assert [len(t) for t in payload["tokens"]] == [6, 6] or "eos" in payload["finish_reason"]


def test_generate_text_prompt_prints_text(exported) -> None:
    code, out, err = run("generate", str(exported("llama-tiny")), "--prompt", "Hello world", "--max-new-tokens", "5")
    assert code == 0
    assert out.strip() != ""
    assert "tokens/s" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "empty"),
        (["--prompt-ids", "1,999999"], "outside"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "5000"], "positions"),
        (["--prompt-ids", "1,2", "--capacity", "3", "--max-new-tokens", "8"], "raise capacity"),
        ([], "give --prompt TEXT, --prompt-ids 1,2,3 (repeatable for a batch) or --chat TEXT"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(exported, args, message) -> None:
    code, out, err = run("generate", str(exported("llama-tiny")), *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvforge: error:")
    assert message in err
    assert out == ""


def test_export_errors(tmp_path, hf_folder) -> None:
    code, _, err = run("export", str(tmp_path / "missing"), "-o", str(tmp_path / "out"))
    assert code == 2 and "missing does not exist; pass a local Hugging Face model folder or a .gguf file" in err
    assert "Traceback" not in err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kvforge.json").write_text('{"format": "kvforge/1"}')
    code, _, err = run("export", str(hf_folder("llama-tiny")), "-o", str(tmp_path / "out"))
    assert code == 2 and "already exists; pass --force to replace it" in err


def test_debug_shows_the_traceback(tmp_path) -> None:
    result = CliRunner().invoke(main, ["--debug", "export", str(tmp_path / "missing"), "-o", str(tmp_path / "o")])
    assert result.exit_code != 0 and result.exception is not None


def test_generate_on_a_folder_that_is_not_an_export(tmp_path) -> None:
    code, _, err = run("generate", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "not a kvforge export" in err


def test_inspect_json(exported) -> None:
    code, out, _ = run("inspect", str(exported("llama-tiny")), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["graphs"]["decode"]["attention_nodes"] == {"com.microsoft.GroupQueryAttention": 2}
    assert "model.weights" in info["files"]


def test_parity_passes_and_fails_with_exit_codes(hf_folder, exported) -> None:
    code, out, _ = run("parity", str(hf_folder("qwen2-tiny")), str(exported("qwen2-tiny")), "--new-tokens", "8", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["passed"] is True and report["max_abs_err"] < 1e-3
    # A gate the export cannot meet: exit 1 (another model as MODEL_DIR is refused before any run: exit 2).
    code, _, err = run("parity", str(hf_folder("qwen2-tiny")), str(exported("qwen2-tiny")), "--new-tokens", "4",
                       "--atol", "1e-12")
    assert code == 1 and "parity failed" in err


def test_demo_builds_exports_generates_and_reuses_its_cache(tmp_path) -> None:
    code, out, _ = run("demo", "-o", str(tmp_path / "demo"), "--recipe", "demo-llama", "--max-new-tokens", "8", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["random_weights"] is True and payload["chat"] is False
    assert len(payload["tokens"]) == 8 and payload["decode_tokens_per_s"] >= 0
    assert "export_s" in payload
    assert (tmp_path / "demo" / "export-ort" / "kvforge.json").is_file()
    # A second run reuses the model folder and the export: nothing is exported again.
    code, out, err = run("demo", "-o", str(tmp_path / "demo"), "--recipe", "demo-llama", "--max-new-tokens", "8", "--json")
    again = json.loads(out)
    assert code == 0 and "export_s" not in again and again["tokens"] == payload["tokens"]


def test_generate_chat_needs_a_chat_template(exported) -> None:
    code, _, err = run("generate", str(exported("llama-tiny")), "--chat", "hi")
    assert code == 2 and "has no chat template" in err
    code, _, err = run("generate", str(exported("llama-tiny")), "--system", "be brief", "--prompt", "hi")
    assert code == 2 and "--system goes with --chat" in err


def test_generate_stream_prints_the_same_text_as_without(exported) -> None:
    folder = str(exported("llama-tiny"))
    code, streamed, _ = run("generate", folder, "--prompt", "Hello world", "--max-new-tokens", "12", "--greedy", "--stream")
    assert code == 0
    code, plain, _ = run("generate", folder, "--prompt", "Hello world", "--max-new-tokens", "12", "--greedy")
    assert code == 0
    assert streamed.strip() == plain.strip() != ""


def test_export_without_the_export_extra_says_what_to_install(tmp_path, monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    code, _, err = run("export", str(tmp_path), "-o", str(tmp_path / "out"))
    assert code == 2
    assert "needs the export extra (torch missing), in the kvforge checkout: pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && pip install -e '.[export]'" in err


def test_help_groups_the_commands_and_gives_every_option_a_text() -> None:
    # Alphabetical, cut summaries, no examples, options without help (issue 43, 20).
    import shlex

    import click

    from kvforge.cli.help import EXAMPLES, SECTIONS

    text = CliRunner().invoke(main, ["--help"]).output
    headings = [line for line in text.splitlines() if line.endswith(" commands:")]
    assert headings == ["Start commands:", "Make commands:", "Run commands:", "Look commands:"], text
    order = [line.split()[0] for line in text.split("Start commands:")[1].splitlines()
             if line.startswith("  ") and line.split()]
    assert order == [name for names in SECTIONS.values() for name in names] == sorted(main.commands, key=order.index)
    assert "..." not in text.split("Start commands:")[1]  # every summary whole
    for name, command in main.commands.items():
        lacking = [p.opts for p in command.params if isinstance(p, click.Option) and not p.help and not p.hidden]
        assert not lacking, (name, lacking)
        shown = CliRunner().invoke(main, [name, "--help"]).output
        assert "Examples:" in shown and EXAMPLES[name], name
        for example in EXAMPLES[name]:  # each parses as written: its options exist, its values fit their types
            args = shlex.split(example)
            assert args[:2] == ["kvforge", name], example
            command.make_context(name, args[2:])


def test_the_group_and_every_command_name_their_own_placeholders_in_option_help() -> None:
    # `--engine-dir` said "default OUT_DIR/engines" where the argument is EXPORT_DIR (issue 43, 22): a FOO_DIR an
    # option's help names must be the command's argument or an option's metavar, as its usage line shows them.
    import re

    import click

    assert all(param.help for param in main.params if isinstance(param, click.Option)), "kvforge's own options"
    for name, command in main.commands.items():
        shown = {p.name.upper() for p in command.params if isinstance(p, click.Argument) and p.name}
        shown |= {p.metavar for p in command.params if isinstance(p, click.Option) and p.metavar}
        for option in (p for p in command.params if isinstance(p, click.Option)):
            named = set(re.findall(r"\b[A-Z]+_DIR\b", option.help or ""))
            assert named <= shown, (name, option.opts, named - shown)


def test_parity_says_which_prompt_of_how_many_and_the_time_left(hf_folder, exported, monkeypatch) -> None:
    # Minutes with no "prompt 2 of 3" and no estimate (issue 43, 19). A clock that moves 10 s a prompt makes the
    # estimate exact: after prompt 1, 2 prompts x 10 s are left; after prompt 2, one.
    import itertools
    import re
    import types

    from kvforge.core.progress import _short
    from kvforge.tools import parity

    clock = itertools.count(0.0, 10.0)
    monkeypatch.setattr(parity, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    code, out, err = run("parity", str(hf_folder("qwen2-tiny")), str(exported("qwen2-tiny")), "--new-tokens", "2",
                         "--perplexity-tokens", "0")
    assert code == 0, err
    said = [re.sub(r"^\[kvforge\] \[\s*[\d.]+s\] ", "", line) for line in err.splitlines()]
    prompts = [line for line in said if line.startswith("prompt ")]
    assert [re.sub(r"\d+ tokens", "N tokens", line) for line in prompts] == [
        "prompt 1 of 3 (N tokens, 'Once upon a time')",
        "prompt 2 of 3 (N tokens, 'The quick brown fox jumps over the lazy '; about 20 s of prompts left)",
        "prompt 3 of 3 (N tokens, 'def main(): return 42'; about 10 s of prompts left)",
    ], err
    # Their heartbeats ("still prompt 'def main() (16 s)" cut inside the quote) name the prompt by its number.
    assert [_short(line) for line in prompts] == ["prompt 1 of 3", "prompt 2 of 3", "prompt 3 of 3"]
    # The report numbers them as the progress did, from 1 (it said "prompt 0" for the first: issue 53, first hour 6).
    assert re.findall(r"^\s+prompt (\d+) \(", out, flags=re.M) == ["1", "2", "3"], out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_no_spin_reaches_the_backend_from_generate_and_chat(command, tmp_path, monkeypatch) -> None:
    # chat lacked --no-spin, which gave 1.5x on a busy CPU (issue 43, 22): both commands hand the backend
    # spinning=False with it, and leave the backend's default without it.
    import kvforge.runtime
    from kvforge.core.errors import InputError

    given: list[dict] = []

    def fake_generator(*args: object, **options: object) -> None:
        given.append(options)
        raise InputError("stopped by the test")

    # generate loads through a Generator, chat through a LoadedExport (its Scheduler's).
    monkeypatch.setattr(kvforge.runtime, "Generator", fake_generator)
    monkeypatch.setattr(kvforge.runtime, "LoadedExport", fake_generator)
    for flag in (["--no-spin"], []):
        code, _, err = run(command, str(tmp_path), "--prompt", "hi", *flag) if command == "generate" else \
            run(command, str(tmp_path), *flag)
        assert code == 2 and "stopped by the test" in err, err
    assert [options.get("spinning") for options in given] == [False, None], given
