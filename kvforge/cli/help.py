"""`kvforge --help` grouped the way a session goes (start, make, run, look) instead of alphabetically, each
command's whole one-line summary (click cuts them to the terminal mid-sentence), and each command's
--help ending with examples that run as written."""

from __future__ import annotations

import click

SECTIONS = {
    "Start": ("demo", "recipes", "doctor"),
    "Make": ("export", "parity", "build"),
    "Run": ("generate", "chat", "serve", "bench"),
    "Look": ("inspect",),
}
SUMMARIES = {
    "demo": "Export a small model and answer with it.",
    "recipes": "List the built-in random-weight recipes.",
    "doctor": "Say what this machine can run, and why not.",
    "export": "Export a Hugging Face model or GGUF to graphs.",
    "parity": "Check an export against Hugging Face eager.",
    "build": "Build TensorRT engines from an export.",
    "generate": "Generate from an export.",
    "chat": "Chat with an export in the terminal.",
    "serve": "Serve an export over an OpenAI-compatible API.",
    "bench": "Time an export against its peers.",
    "inspect": "Show what an export or its engines hold.",
}
DEMO = "kvforge-demo/smollm2-135m-instruct-ort"  # what `kvforge demo` leaves behind
EXAMPLES = {
    "demo": ["kvforge demo", "kvforge demo --recipe llama-tiny -o /tmp/demo --json"],
    "recipes": ["kvforge recipes"],
    "doctor": ["kvforge doctor --json"],
    "export": ["kvforge export ./my-hf-model -o my-export",
               "kvforge export ./my-hf-model -o my-export-int4 --quantize int4",
               "kvforge export --recipe llama-tiny -o tiny --target trt"],
    "parity": ["kvforge parity kvforge-demo/smollm2-135m-instruct.hf " + DEMO],
    "build": ["kvforge build tiny-trt-export --max-seq-len 2048"],
    "generate": [f"kvforge generate {DEMO} --prompt 'Once upon a time' --max-new-tokens 32",
                 f"kvforge generate {DEMO} --chat 'What is the capital of France?' --greedy"],
    "chat": [f"kvforge chat {DEMO} --system 'Be brief.'"],
    "serve": [f"kvforge serve {DEMO} --port 8000 --max-batch 4"],
    "bench": [f"kvforge bench {DEMO} --compare hf --repeat 3"],
    "inspect": [f"kvforge inspect {DEMO} --verify"],
}


def format_sections(group: click.Group, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    """The group's commands under SECTIONS' headings; any command not placed there goes under "Other"."""
    placed = {name for names in SECTIONS.values() for name in names}
    sections = {**SECTIONS, "Other": tuple(sorted(set(group.list_commands(ctx)) - placed))}
    for title, names in sections.items():
        rows = [(name, group.commands[name].get_short_help_str(limit=200)) for name in names
                if name in group.commands and not group.commands[name].hidden]
        if rows:
            with formatter.section(f"{title} commands"):
                formatter.write_dl(rows)


def finish(group: click.Group) -> None:
    """Give each command its whole summary and its examples (an epilog kept as written)."""
    for name, command in group.commands.items():
        if name in SUMMARIES:
            command.short_help = SUMMARIES[name]
        if name in EXAMPLES:
            command.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
