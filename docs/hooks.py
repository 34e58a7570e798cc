"""MkDocs hook (mkdocs.yml `hooks:`): the tables that come from kvforge's registry are written into the
pages at build time, so the site cannot drift from the code.

A page asks for a table with an HTML comment on a line of its own:

    <!-- kvforge:support-table -->    kvforge.models.families.support_table(): families x targets, dtypes
    <!-- kvforge:coverage-table -->   kvforge.tools.coverage_table.coverage_table(): the architecture sweep
    <!-- kvforge:commands -->         kvforge.cli.help.markdown_overview(): the commands as --help groups them

README.md carries the support table as text (tests/families/test_families.py keeps it equal to the registry).
"""

from __future__ import annotations

import re
from collections.abc import Callable

MARKER = re.compile(r"^<!-- kvforge:([a-z-]+) -->$", flags=re.M)


def _support_table() -> str:
    from kvforge.models.families import support_table

    return support_table()


def _coverage_table() -> str:
    from kvforge.tools.coverage_table import coverage_table

    return coverage_table()


def _commands() -> str:
    from kvforge.cli import main
    from kvforge.cli.help import markdown_overview

    return markdown_overview(main)


TABLES: dict[str, Callable[[], str]] = {"support-table": _support_table, "coverage-table": _coverage_table,
                                        "commands": _commands}


def render(markdown: str) -> str:
    """`markdown` with every marker replaced by its table; an unknown marker is an error."""

    def table(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(f"unknown kvforge table marker {name!r} (known: {', '.join(TABLES)})")
        return TABLES[name]()

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    return render(markdown)
