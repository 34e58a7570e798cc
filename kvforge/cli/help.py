"""`kvforge --help` grouped the way a session goes (start, make, run, look) instead of alphabetically, each
command's whole one-line summary (click cuts them to the terminal mid-sentence), and each command's
--help ending with examples that run as written; the site's CLI reference gets the same overview
(markdown_overview, written into docs/cli.md by docs/hooks.py)."""

from __future__ import annotations

import click

SECTIONS = {
    "Start": ("demo", "recipes", "doctor"),
    "Make": ("export", "parity", "build"),
    "Run": ("generate", "chat", "transcribe", "serve", "bench"),
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
    "transcribe": "Transcribe audio files with a Whisper export.",
    "serve": "Serve an export over an OpenAI-compatible API.",
    "bench": "Time an export against its peers.",
    "inspect": "Show what an export or its engines hold.",
}
DEMO = "kvforge-demo/smollm2-135m-instruct-ort"  # what `kvforge demo` leaves behind
EXAMPLES = {
    "demo": ["kvforge demo", "kvforge demo --recipe llama-tiny -o /tmp/demo --json"],
    "recipes": ["kvforge recipes"],
    "doctor": ["kvforge doctor --json"],
    "export": ["kvforge export MODEL_DIR -o EXPORT_DIR",
               "kvforge export MODEL_DIR -o EXPORT_DIR --quantize int4",
               "kvforge export --recipe llama-tiny -o tiny-trt --target trt"],
    "parity": ["kvforge parity kvforge-demo/smollm2-135m-instruct.hf " + DEMO],
    "build": ["kvforge build tiny-trt --max-seq-len 2048"],  # the folder export's trt example makes
    "generate": [f"kvforge generate {DEMO} --prompt 'Once upon a time' --max-new-tokens 32",
                 f"kvforge generate {DEMO} --chat 'What is the capital of France?' --greedy"],
    "chat": [f"kvforge chat {DEMO} --system 'Be brief.'"],
    "transcribe": ["kvforge transcribe WHISPER_EXPORT speech.wav --language en --json"],
    "serve": [f"kvforge serve {DEMO} --port 8000 --max-batch 4"],
    "bench": [f"kvforge bench {DEMO} --compare hf --repeat 3"],
    "inspect": [f"kvforge inspect {DEMO} --verify"],
}


def sections(group: click.Group) -> dict[str, list[str]]:
    """SECTIONS' headings with the group's (visible) commands under each; a command not placed there (a new
    one) goes under "Other", so it is never left out of the help."""
    placed = {name for names in SECTIONS.values() for name in names}
    found = {**SECTIONS, "Other": tuple(sorted(set(group.commands) - placed))}
    listed = {title: [name for name in names if name in group.commands and not group.commands[name].hidden]
              for title, names in found.items()}
    return {title: names for title, names in listed.items() if names}


def format_sections(group: click.Group, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    """The group's commands under their headings, each with its whole summary."""
    grouped = sections(group)
    # click sizes each list's first column to its own names; one width keeps the summaries in one column.
    width = max(len(name) for names in grouped.values() for name in names)
    for title, names in grouped.items():
        with formatter.section(f"{title} commands"):
            formatter.write_dl([(name.ljust(width), group.commands[name].get_short_help_str(limit=200))
                                for name in names])


def markdown_overview(group: click.Group) -> str:
    """The commands by section with their summaries and examples, as Markdown: the site's CLI reference
    (docs/hooks.py) shows what --help shows, which mkdocs-click does not (it sorts, and drops epilogs). Each
    name links to its mkdocs-click section (`kvforge-NAME`: mkdocs.yml has attr_list, so the full path)."""
    lines = []
    for title, names in sections(group).items():
        lines += [f"**{title}**", ""]
        for name in names:
            command = group.commands[name]
            examples = "; ".join(f"`{line}`" for line in EXAMPLES.get(name, ()))
            label = "Examples" if len(EXAMPLES.get(name, ())) > 1 else "Example"
            lines.append(f"- [`{name}`](#kvforge-{name}): {command.get_short_help_str(limit=200)}"
                         + (f" {label}: {examples}" if examples else ""))
        lines.append("")
    return "\n".join(lines)


def finish(group: click.Group) -> None:
    """Give each command its whole summary and its examples (an epilog kept as written)."""
    for name, command in group.commands.items():
        if name in SUMMARIES:
            command.short_help = SUMMARIES[name]
        if name in EXAMPLES:
            command.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
