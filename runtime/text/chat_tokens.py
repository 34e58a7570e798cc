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
                     special_tokens_in_content: bool = False, allowed: tuple[str, ...] = ()) -> list[int]:
    """Token ids of `messages` as `render` writes them. `encode` tokenizes the template's text
    (default: the tokenizer, special-token text parsed, no BOS added). `allowed`: special-token texts a
    message's content may hold as such (a vision-language export's image placeholder, which `encode` places)."""
    encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    specials = [text for text in tokenizer.special_texts if text not in allowed]
    typed = re.compile("|".join(map(re.escape, specials))) if specials else None
    if special_tokens_in_content or typed is None or not any(
            isinstance(m.get("content"), str) and typed.search(m["content"]) for m in messages):
        return encode(render(messages))
    nonce = secrets.token_hex(8)  # a marker no message can already hold
    originals: list[str] = []

    def marker(match: re.Match) -> str:
        originals.append(match.group())
        return f"\ue000{nonce}:{len(originals) - 1}\ue001"

    marked = [dict(m, content=typed.sub(marker, m["content"])) if isinstance(m.get("content"), str) else m
              for m in messages]
    text = render(marked)
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
    return ids
