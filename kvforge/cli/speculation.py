"""Speculative decoding's command-line options: `kvforge generate` and `kvforge chat` (speculation_options, checked
by check_flags before anything loads) and `kvforge serve` (serve_speculation_options, check_serve_flags).

    --speculate prompt-lookup | draft | eagle | mtp    (runtime/controls/speculate.py METHODS; serve: the default
                                                       of requests that name no method)
    --draft DIR        the draft export of method `draft` (a smaller model with the target's vocabulary)
    --draft-len K      most tokens drafted per step (1..15)
    --adaptive-draft / --no-adaptive-draft             serve: each request's draft length follows its acceptance

The checks against the loaded target and the --json report are kvforge/tools/speculation.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click
from click import Command

from kvforge.core.errors import InputError

# runtime/controls/speculate.py's METHODS, DEFAULT_DRAFT_LEN and MAX_DRAFT_LEN (not imported here: startup time;
# tests/cli/test_speculation_cli.py checks they agree).
METHODS = ("prompt-lookup", "draft", "eagle", "mtp")
DEFAULT_DRAFT_LEN = 6
MAX_DRAFT_LEN = 15

SPECULATE_HELP = ("Speculative decoding: drafts verified by the model in one step, the same tokens greedy decoding "
                  "(or the same distribution sampling) gives. prompt-lookup copies from the context; draft runs "
                  "--draft DIR; eagle / mtp run the export's speculation head (exported with --eagle / --mtp).")
DRAFT_HELP = ("With --speculate draft: the draft export, a smaller model with the target's vocabulary (e.g. the "
              "target's own int4 export).")
NEEDS_DRAFT = ("--speculate draft needs --draft DIR: an export of a smaller model with the target's vocabulary (e.g. "
               "the target's int4 export: kvforge export MODEL_DIR -o DRAFT_DIR --quantize int4)")
DRAFT_LEN_HELP = f"With --speculate: most tokens drafted per step (1..{MAX_DRAFT_LEN})."


def speculation_options(speculate_help: str = SPECULATE_HELP) -> Callable[[Command], Command]:
    """--speculate, --draft, --draft-len (generate, chat, serve)."""
    def add(command: Command) -> Command:
        for option in reversed((
            click.option("--speculate", type=click.Choice(METHODS), default=None, help=speculate_help),
            click.option("--draft", type=click.Path(path_type=Path), default=None, metavar="DIR", help=DRAFT_HELP),
            click.option("--draft-len", default=DEFAULT_DRAFT_LEN, show_default=True, type=int, help=DRAFT_LEN_HELP),
        )):
            command = option(command)
        return command
    return add


def check_flags(speculate: str | None, draft: Path | None, draft_len: int) -> None:
    """The flags together, before anything loads: --draft-len and --draft only with --speculate (--draft with
    `draft` alone, which needs it), --draft-len in range."""
    from kvforge.cli.common import refuse_unused

    refuse_unused("speculate", speculate is not None, "draft_len")
    if draft is not None and speculate != "draft":
        raise InputError(f"--draft DIR goes with --speculate draft{'' if speculate is None else f', not {speculate}'}")
    if speculate == "draft" and draft is None:
        raise InputError(NEEDS_DRAFT)
    if speculate is not None and (isinstance(draft_len, bool) or not 1 <= draft_len <= MAX_DRAFT_LEN):
        raise InputError(f"--draft-len must be an integer in 1..{MAX_DRAFT_LEN}, got {draft_len}")


SERVE_SPECULATE_HELP = ("The speculation of requests that name none (a request's \"speculate\": {\"method\": ..., "
                        "\"draft_len\": N} chooses its own, \"speculate\": false opts out): prompt-lookup, draft "
                        "(--draft DIR), eagle / mtp (the export's speculation head). Default: none.")
SERVE_DRAFT_HELP = ("The draft export of method draft (the default's or a request's): a smaller model with the "
                    "target's vocabulary (e.g. the target's own int4 export).")
SERVE_DRAFT_LEN_HELP = (f"Most tokens drafted per step (1..{MAX_DRAFT_LEN}) for the default and for requests that "
                        "name a method without draft_len.")
ADAPTIVE_HELP = "Each speculative request's draft length follows its acceptance, within 1..--draft-len."


def serve_speculation_options(command: Command) -> Command:
    """`kvforge serve`'s --speculate, --draft, --draft-len and --adaptive-draft/--no-adaptive-draft."""
    for option in reversed((
        click.option("--speculate", type=click.Choice(METHODS), default=None, help=SERVE_SPECULATE_HELP),
        click.option("--draft", type=click.Path(path_type=Path), default=None, metavar="DIR", help=SERVE_DRAFT_HELP),
        click.option("--draft-len", default=DEFAULT_DRAFT_LEN, show_default=True, type=int, help=SERVE_DRAFT_LEN_HELP),
        click.option("--adaptive-draft/--no-adaptive-draft", "adaptive_draft", default=True, show_default=True,
                     help=ADAPTIVE_HELP),
    )):
        command = option(command)
    return command


def check_serve_flags(speculate: str | None, draft: Path | None, draft_len: int) -> None:
    """`kvforge serve`'s flags, before anything loads. Unlike generate's, --draft and --draft-len stand without
    --speculate: a request may name method draft, and the length is also that of requests that give none."""
    if speculate == "draft" and draft is None:
        raise InputError(NEEDS_DRAFT)
    if isinstance(draft_len, bool) or not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise InputError(f"--draft-len must be an integer in 1..{MAX_DRAFT_LEN}, got {draft_len}")
