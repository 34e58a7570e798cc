"""Chat templates without transformers: the export folder's Jinja template rendered the way
transformers' `apply_chat_template` renders it, then tokenized without adding special tokens (the
template writes them itself).

The template is untrusted text from a model folder, so it runs in Jinja's immutable sandbox, with the
environment transformers uses: trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII text, and the `raise_exception` / `strftime_now` helpers templates call. The template is
read (and hashed against the manifest) once, when the export is loaded; `render` bounds the output
size and turns any failure of the template into an InputError that names it. A template can still
loop forever in pure Python: the server renders in a separate process it can kill
(runtime/text/chat_worker.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError, ManifestError

# A rendered prompt longer than this is a template gone wrong (no context window holds it).
MAX_RENDERED_CHARS = 4 << 20


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _generation() -> Any:
    """The `{% generation %}...{% endgeneration %}` block transformers' environment knows (it marks an assistant's
    tokens for training masks; LLaVA's released templates use it): rendered as its body, as transformers renders it."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


@lru_cache(maxsize=8)
def reads_content_parts(template: str) -> bool:
    """Whether the template loops over a message's `content` (as a list of {"type": ...} parts, the form
    transformers' processors pass a vision-language model's templates), rather than writing it as one string."""
    import jinja2.nodes as nodes

    try:
        tree = _compile(template).environment.parse(template)
    except Exception:  # a broken template fails when rendered, with its own message
        return False
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, (nodes.Filter, nodes.Test)) and source.node is not None:
            source = source.node
        if (isinstance(source, nodes.Getattr) and source.attr == "content") or (
                isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const)
                and source.arg.value == "content"):
            return True
    return False


@dataclass(frozen=True)
class ChatTemplate:
    """An export's chat template as read (once) at load: its text, the special tokens it may refer
    to, and the file it came from (named in errors)."""

    text: str
    specials: dict[str, str] = field(default_factory=dict)
    source: str = "the chat template"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        return render(self.text, messages, self.specials, add_generation_prompt, name=self.source, tools=tools)


def _read_verified(folder: Path, name: str, manifest: dict[str, Any]) -> str | None:
    """The text of `folder/name` (None if absent), refusing a link out of the folder and checking the
    bytes read against the manifest's sha256 when it lists the file: what is hashed is what is used."""
    from kvforge.core.manifest import resolve_in_folder

    path = resolve_in_folder(Path(folder), name, f"the chat template file {name}")
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ManifestError(f"could not read {path}: {err.strerror or err}; re-run the export") from err
    files = manifest.get("files")
    record = files.get(name) if isinstance(files, dict) else None
    if isinstance(record, dict) and hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise ManifestError(f"{path} does not match the sha256 in kvforge.json: the file was modified or replaced "
                            "after the export; re-run the export")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(f"{path} is not UTF-8 text ({err}); re-run the export") from err


def read_chat_template(folder: Path, manifest: dict[str, Any]) -> ChatTemplate | None:
    """The export's chat template, read and verified once (None if the export has none)."""
    template, specials, source = _load(Path(folder), manifest)
    return None if template is None else ChatTemplate(template, specials, source)


BUILTIN_TEMPLATES = ("chatml-tools",)  # kvforge/data/<name>.jinja


def chat_template_override(name: str | Path, folder: Path, manifest: dict[str, Any]) -> ChatTemplate:
    """A chat template given instead of the export's (`kvforge serve --chat-template`): the name of
    one kvforge ships (BUILTIN_TEMPLATES) or a UTF-8 file, with the export's special tokens."""
    from importlib.resources import files

    path = Path(str(files("kvforge") / "data" / f"{name}.jinja")) if str(name) in BUILTIN_TEMPLATES else Path(name)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read the chat template {name} ({getattr(err, 'strerror', None) or err}); give a "
                         f"UTF-8 Jinja file or one of {', '.join(BUILTIN_TEMPLATES)}") from None
    if not text.strip():  # would render every conversation as nothing: the model would answer an empty prompt
        raise InputError(f"the chat template {name} is empty; give a Jinja chat template (the model's own is in "
                         f"its tokenizer_config.json) or one of {', '.join(BUILTIN_TEMPLATES)}")
    _, specials, _ = _load(Path(folder), manifest)
    return ChatTemplate(text, specials, f"the chat template {name}")


def _load(folder: Path, manifest: dict[str, Any]) -> tuple[str | None, dict[str, str], str]:
    config: dict[str, Any] = {}
    config_text = _read_verified(folder, "tokenizer_config.json", manifest)
    config_file = folder / "tokenizer_config.json"
    if config_text is not None:
        try:
            config = json.loads(config_text)
        except (ValueError, RecursionError) as err:
            raise ManifestError(f"{config_file} is not valid JSON ({err}); re-run the export") from err
        if not isinstance(config, dict):
            raise ManifestError(f"{config_file} is not a JSON object; re-run the export")
    template, where = None, "the chat template"
    source = manifest.get("chat_template")
    if source == "chat_template.jinja":
        template = _read_verified(folder, source, manifest)
        where = str(folder / source)
    if template is None and isinstance(config.get("chat_template"), str):
        template, where = config["chat_template"], f"the chat template in {config_file}"
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken serialised as a dict
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return template, specials, where


def render(template: str, messages: list[dict[str, Any]], specials: dict[str, str],
           add_generation_prompt: bool = True, *, name: str = "the chat template",
           max_chars: int = MAX_RENDERED_CHARS, tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text (`tools`, OpenAI's tool list, is the template's `tools` variable, left
    undefined when None); any failure of the template (its own refusal, a Python error such as
    `{{ 1/0 }}`, deep recursion, more than `max_chars` of output) is an InputError naming it."""
    import jinja2

    try:
        # generate() yields the output piece by piece, so a runaway loop that writes is stopped at
        # max_chars rather than after filling memory.
        pieces, size = [], 0
        extra = {} if tools is None else {"tools": tools}
        for piece in _compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **specials, **extra):
            size += len(piece)
            if size > max_chars:
                raise InputError(f"{name} rendered more than {max_chars} characters for these messages; "
                                 "the template is broken (or loops): fix or replace it")
            pieces.append(piece)
        return "".join(pieces)
    except InputError:
        raise
    except jinja2.exceptions.TemplateError as err:
        raise InputError(f"{name} refused these messages: {err}") from err
    except (RecursionError, MemoryError) as err:
        raise InputError(f"{name} ran out of {'stack' if isinstance(err, RecursionError) else 'memory'} rendering "
                         "these messages; the template is broken (or loops): fix or replace it") from err
    except Exception as err:  # a template is code: 1/0, a bad attribute, a type error ...
        raise InputError(f"{name} failed on these messages: {type(err).__name__}: {err}") from err
