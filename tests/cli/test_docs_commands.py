"""Every `kvforge ...` command line that README.md and docs/*.md show goes through the CLI's own parser, as
`kvforge` would parse it (issue 53, first hour 2: `kvforge export llava-1.5-7b-hf llava-ort` lacked `-o`, and
its test called `export_model()`, not the CLI). An unknown command or option, a bad value or a missing required
argument or option fails, naming the page and line; nothing is run (tests/cli/test_readme_examples.py runs the
blocks that can run, and tests/cli/test_docs.py holds every other block to a reason why not).

Taken from the code blocks (bash, sh, shell, console): each logical line (`\\` continuations joined, heredoc
bodies and comments left out, a console's `$ ` prompt dropped), split at `&&`, `||`, `;` and pipes, with
`NAME=value` prefixes and `exec`/`time` dropped. A usage line's `[--option VALUE]` counts as given and its
`a|b` values are each checked. From the prose: an inline `kvforge COMMAND ...` that names its inputs (a
positional word, or `-o`) is a whole command and checked whole; one that only mentions options
(`kvforge bench --compare`) has its options and their values checked.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from kvforge.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")
ALT = "\x00"  # stands for a `|` inside a word (a usage line's alternatives) while a line is split at pipes
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|\$\{?\w+\}?)$")  # MODEL_DIR, OUT, N, $M, ${GGUF}


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    text: str  # the command as the page shows it, from `kvforge` on
    whole: bool  # False: an inline mention of options, not a command to run

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: `{self.text}`"


def _logical_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """A shell block's lines with `\\` continuations joined, heredoc bodies left out: (page line, text)."""
    lines, pending, start, heredoc = [], "", 0, None
    for number, raw in enumerate(body.splitlines(), first_line):
        if heredoc is not None:
            heredoc = None if raw.strip() == heredoc else heredoc
            continue
        if not pending:
            start = number
            raw = re.sub(r"^\s*\$ ", "", raw)  # a console block's prompt
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + raw))
        pending = ""
        tag = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", raw)
        heredoc = tag.group(1) if tag else None
    return lines


def _segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as words (comments out; split at pipes, `;`, `&&`, `||`)."""
    line = re.sub(r"(?<=[^\s|])\|(?=[^\s|])", ALT, line)  # `int4|int8` is a choice, not a pipe
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    for word in lexer:
        if word and set(word) <= set(";&|()"):
            segments.append([])
        else:
            segments[-1].append(word)
    return [words for words in segments if words]


def _kvforge_words(words: list[str]) -> list[str] | None:
    """The words after `kvforge` when this simple command runs it, else None."""
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in ("exec", "time", "command")):
        words = words[1:]
    if words[:1] == ["kvforge"]:
        return words[1:]
    if words[:3] in (["python", "-m", "kvforge"], ["python3", "-m", "kvforge"]):
        return words[3:]
    return None


def commands_in(page: str, root: Path = ROOT) -> list[DocCommand]:
    """Every kvforge command line of `page` (under `root`): its shell code blocks', then its prose's inline ones."""
    text = (root / page).read_text()
    found = []
    for fence in re.finditer(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M):
        if fence.group(1) not in SHELL_FENCES:
            continue
        first = text.count("\n", 0, fence.start(2)) + 1
        for number, line in _logical_lines(fence.group(2), first):
            for words in _segments(_usage(line)):
                args = _kvforge_words(words)
                if args is not None:
                    found.append(DocCommand(page, number, shlex.join(["kvforge", *args]).replace(ALT, "|"), True))
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", lambda block: "\n" * block.group(0).count("\n"), text,
                   flags=re.S | re.M)
    for inline in re.finditer(r"`(kvforge [a-z][^`]*)`", prose):
        command = " ".join(re.split(r"\s\|\s", _usage(inline.group(1)))[0].split())
        number = text.count("\n", 0, inline.start()) + 1
        found.append(DocCommand(page, number, command, _is_whole(command)))
    return found


def _usage(line: str) -> str:
    """A usage line's optional `[--option VALUE]` counted as given."""
    return re.sub(r"\[(--[^\]\[]*)\]", r"\1", line)


def _is_whole(command: str) -> bool:
    """An inline command that names its inputs (a positional word first, or `-o`) is a whole command to check;
    a bare one whose command needs no input (`kvforge doctor`) too."""
    words = command.split()[1:]
    if "..." in words or not words or words[0].startswith("-"):
        return False
    if len(words) > 1:
        return not words[1].startswith("-") or "-o" in words or "--output" in words
    sub = main.commands.get(words[0])  # type: ignore[attr-defined]
    return sub is None or not any(param.required for param in sub.params)  # an unknown one fails whole


def _alternatives(words: list[str]) -> list[list[str]]:
    """A usage line's `int4|int8` values, each in its own command line."""
    choices = [word.replace(ALT, "|").split("|") if "|" in word.replace(ALT, "|") and not word.startswith("-")
               else [word] for word in words]
    return [list(combination) for combination in itertools.product(*choices)]


def _typed_placeholders(command: click.Command, words: list[str]) -> list[str]:
    """A placeholder given to a number option (`--replicas N`) stands for a number: give the parser one."""
    numeric = {option for param in command.params if isinstance(param, click.Option)
               and isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))
               for option in param.opts}
    return ["1" if PLACEHOLDER.match(word) and index and words[index - 1] in numeric else word
            for index, word in enumerate(words)]


def parse(command: DocCommand) -> None:
    """Parse `command` as `kvforge` would, without running it: raises click's error for what is wrong."""
    for words in _alternatives(shlex.split(command.text)[1:]):
        words = [word for word in words if word != "..."]
        if not command.whole:  # options named in passing: each must exist and take its value
            if not words or words[0].startswith("-"):
                main.make_parser(click.Context(main)).parse_args(words)
                continue
            sub = main.get_command(click.Context(main), words[0])
            if sub is None:
                raise click.UsageError(f"No such command {words[0]!r}.")
            try:
                sub.make_parser(click.Context(sub)).parse_args(_typed_placeholders(sub, words[1:]))
            except click.BadOptionUsage as err:  # `kvforge generate --image`: the option named, not its value
                if not err.message.endswith("requires an argument.") or words[-1] != err.option_name:
                    raise
            continue
        with main.make_context("kvforge", list(words), resilient_parsing=False) as group:
            # The subcommand and its words, as click's Group.invoke takes them after the group's options.
            name, sub, rest = main.resolve_command(group, [*group._protected_args, *group.args])
            assert sub is not None and name is not None
            sub.make_context(name, _typed_placeholders(sub, rest), parent=group, resilient_parsing=False).close()


def _all_commands() -> list[DocCommand]:
    from kvforge.cli.help import EXAMPLES

    # The examples docs/hooks.py writes into docs/cli.md (and --help shows).
    examples = [DocCommand("docs/cli.md (kvforge --help's examples)", 0, example, True)
                for examples in EXAMPLES.values() for example in examples]
    return [command for page in PAGES for command in commands_in(page)] + examples


@pytest.mark.parametrize("command", _all_commands(), ids=lambda command: f"{command.page}: {command.text}")
def test_every_command_the_docs_show_parses(command: DocCommand) -> None:
    try:
        parse(command)
    except click.exceptions.Exit as done:  # --help, --version
        assert done.exit_code == 0, command
    except click.ClickException as err:
        pytest.fail(f"{command}: kvforge would refuse it: {err.format_message()}")


def test_the_docs_show_the_commands_this_finds() -> None:
    # The extraction itself: each page's blocks and prose, the demo line's last `&&` command, a piped one.
    found = {str(command) for command in _all_commands()}
    assert sum("README.md:" in line for line in found) >= 5
    assert any(line.endswith("`kvforge demo`") and "README.md" in line for line in found)
    assert any("kvforge chat kvforge-demo/smollm2-135m-instruct-ort --greedy --quiet" in line for line in found)
    assert {command.page for command in _all_commands()} >= {"README.md", "docs/quickstart.md", "docs/cli.md",
                                                              "docs/quantisation.md", "docs/serving.md"}


def _written(page_text: str, tmp_path: Path) -> list[DocCommand]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "probe.md").write_text(page_text)
    return commands_in("docs/probe.md", root=tmp_path)


def _refusal(command: DocCommand) -> str:
    with pytest.raises(click.ClickException) as refused:
        parse(command)
    return refused.value.format_message()


def test_what_the_extraction_takes_from_a_page(tmp_path: Path) -> None:
    page = ("Intro with `kvforge export M --quantize int4` and `kvforge bench --compare hf`.\n\n"
            "```bash\n"
            "$ FOO=1 kvforge export MODEL \\\n"
            "    -o OUT --quantize int4|int8   # a comment --nope\n"
            "cat > x.yaml <<EOF\nkvforge not-a-command\nEOF\n"
            "printf 'hi\\n' | kvforge chat OUT --greedy && kvforge serve OUT --replicas N --ray\n"
            "kvforge export MODEL -o OUT [--block-size 32]\n"
            "```\n")
    commands = _written(page, tmp_path)
    assert [(command.line, command.text, command.whole) for command in commands] == [
        (4, "kvforge export MODEL -o OUT --quantize 'int4|int8'", True),
        (9, "kvforge chat OUT --greedy", True),
        (9, "kvforge serve OUT --replicas N --ray", True),
        (10, "kvforge export MODEL -o OUT --block-size 32", True),
        (1, "kvforge export M --quantize int4", True),
        (1, "kvforge bench --compare hf", False),
    ]
    for command in commands[:4] + commands[5:]:
        parse(command)  # placeholders stand for paths, `N` for a number; `int4|int8` both parse
    assert "Missing option '-o'" in _refusal(commands[4])  # the prose's export line without -o


@pytest.mark.parametrize(("line", "refused"), [
    ("kvforge export MODEL OUT", "Missing option '-o'"),
    ("kvforge export MODEL -o OUT --no-such-option", "No such option '--no-such-option'"),
    ("kvforge export MODEL -o OUT --quantize int3", "'int3' is not one of 'int4', 'int8'"),
    ("kvforge export MODEL -o OUT --quantize int4|int5", "'int5' is not one of"),
    ("kvforge exprot MODEL -o OUT", "No such command 'exprot'"),
    ("kvforge serve OUT --port eighty", "'eighty' is not a valid integer"),
    ("kvforge parity MODEL", "Missing argument 'EXPORT_DIR'"),
])
def test_a_broken_command_line_fails_naming_what_is_wrong(tmp_path: Path, line: str, refused: str) -> None:
    (command,) = _written(f"```bash\n{line}\n```\n", tmp_path)
    assert refused in _refusal(command)


def test_an_inline_mention_of_options_has_them_checked(tmp_path: Path) -> None:
    (mention,) = _written("Use `kvforge bench --compare-with hf` for that.\n", tmp_path)
    assert not mention.whole and "No such option '--compare-with'" in _refusal(mention)
