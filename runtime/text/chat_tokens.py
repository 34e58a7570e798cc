"""A rendered conversation's token ids, with the messages' own text kept as text.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`) around each message, and the
rendered text is tokenized with special-token text parsed, so that those become the control tokens.
Parsed the same way, a user who types `<|im_end|><|im_start|>system` would close their turn and open a
system one. So special-token text inside a message's content is swapped for a marker before
rendering, the template's text around it is tokenized as before, and each marker is tokenized as
plain text. A conversation whose contents hold no special-token text is tokenized exactly as before
(one encode of the whole rendering); `special_tokens_in_content=True` keeps the old behaviour
(trusted input only).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from kvforge.core.errors import InputError
from kvforge.runtime.text.tokenizer import Tokenizer


def conversation_ids(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]],
                     tokenizer: Tokenizer, encode: Callable[[str], list[int]] | None = None,
                     special_tokens_in_content: bool = False, keep_as_text: tuple[str, ...] = (),
                     flatten: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
                     finish: Callable[[str, list[int]], list[int]] | None = None) -> list[int]:
    """Token ids of `messages` as `render` writes them. `encode` tokenizes the template's text
    (default: the tokenizer, special-token text parsed, no BOS added). `keep_as_text`: more texts that a message's
    content holds as text, never as what `encode` makes of them (a vision-language export's image placeholder:
    only image parts make image places). A content may be a str or a list of {"type": "text", "text": ...} and
    {"type": "image"} parts; `flatten` turns the (marked) messages into what `render` takes, `finish` maps the
    rendered text and its ids to the final ids (a processor's BOS)."""
    encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    flatten = flatten or (lambda ms: ms)
    finish = finish or (lambda _, ids: ids)
    typed_texts = sorted({*tokenizer.special_texts, *keep_as_text}, key=len, reverse=True)
    typed = re.compile("|".join(map(re.escape, typed_texts))) if typed_texts else None
    if special_tokens_in_content or typed is None or not any(typed.search(text) for text in _texts(messages)):
        text = render(flatten(messages))
        return finish(text, encode(text))
    nonce = secrets.token_hex(8)  # a marker no message can already hold
    originals: list[str] = []

    def marker(match: re.Match) -> str:
        originals.append(match.group())
        return f"\ue000{nonce}:{len(originals) - 1}\ue001"

    text = render(flatten([_marked(m, lambda t: typed.sub(marker, t)) for m in messages]))
    pieces = re.split(f"\ue000{nonce}:([0-9]+)\ue001", text)
    if any(nonce in piece for piece in pieces[::2]):
        raise InputError("the chat template changed the messages' text around a special token (such as "
                         f"{originals[0]!r}) that a message holds, so it cannot be kept as text; remove it")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += encode(piece) if piece else []
        else:
            ids += tokenizer.encode_as_text(originals[int(piece)])
    return finish(text, ids)


def _texts(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of the messages' contents (a str content, or the text parts of a list)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return out


def _marked(message: dict[str, Any], mark: Callable[[str], str]) -> dict[str, Any]:
    """`message` with `mark` applied to its content's text (a str, or each text part of a list)."""
    content = message.get("content")
    if isinstance(content, str):
        return dict(message, content=mark(content))
    if isinstance(content, list):
        return dict(message, content=[dict(part, text=mark(part["text"])) if isinstance(part, dict)
                                      and isinstance(part.get("text"), str) else part for part in content])
    return message
