"""Chat templates without transformers: the export folder's Jinja template rendered the way
transformers' `apply_chat_template` renders it, then tokenized without adding special tokens (the
template writes them itself).

The template is untrusted text from a model folder, so it runs in Jinja's immutable sandbox, with the
environment transformers uses: trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII text, and the `raise_exception` / `strftime_now` helpers templates call.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvforge.errors import InputError, ManifestError

ROLES = ("system", "user", "assistant", "tool")


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_chat_template(folder: Path, manifest: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The export's chat template (or None) and the special tokens a template may refer to."""
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as err:
            raise ManifestError(f"{config_file} is not valid JSON ({err}); re-run the export") from err
    template = None
    source = manifest.get("chat_template")
    if source == "chat_template.jinja" and (folder / source).is_file():
        template = (folder / source).read_text()
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken serialised as a dict
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return template, specials


def check_messages(messages: Any) -> list[dict[str, str]]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts (or one str)")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise InputError(f"message {i} must be a dict with str 'role' and 'content', got {message!r}")
        if message["role"] not in ROLES:
            raise InputError(f"message {i} has role {message['role']!r}; use one of {', '.join(ROLES)}")
        out.append(dict(message))
    return out


def render(template: str, messages: list[dict[str, str]], specials: dict[str, str],
           add_generation_prompt: bool = True) -> str:
    import jinja2

    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
    except jinja2.exceptions.TemplateError as err:
        raise InputError(f"the chat template refused these messages: {err}") from err
