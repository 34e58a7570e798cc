"""A vision-language export's conversation as token ids, as transformers' processor apply_chat_template gives them:
the chat template's rendering (runtime/text) with each image part's place made the family's image tokens
(runtime/media). A driver's work: it joins the two roles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvforge.runtime.media.image_prompt import chat_placeholder, flatten_parts, images_around, processor_ids
from kvforge.runtime.text.chat import reads_content_parts
from kvforge.runtime.text.chat_tokens import conversation_ids


def image_chat_ids(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], tokenizer: Any,
                   template: Any, vision: dict[str, Any], encode: Callable[[str], list[int]],
                   special_tokens_in_content: bool = False) -> list[int]:
    """A vision-language export's conversation (checked messages whose contents may hold {"type": "image"} parts)
    as token ids, as transformers' processor apply_chat_template(tokenize=True) gives them, each image place the
    template writes one image token: the template gets content lists as parts when it reads parts (a str content
    as one text part, which transformers would pass as a str that LLaVA's templates drop; else each list joined by
    newlines, an image as its placeholder), the placeholder typed in a message stays text (as special-token
    text does, runtime/text/chat_tokens.py), the processor's own prefix (`prompt_prefix`) goes before the rendering,
    and the tokenizer's special tokens (BOS) are added unless the rendering starts with them. `template`: a ChatTemplate; `encode`: text -> ids, no special tokens added."""
    placeholder = chat_placeholder(vision)
    if reads_content_parts(template.text):  # a str content as one text part: such templates read only parts
        messages = [dict(m, content=[{"type": "text", "text": m["content"]}]) if isinstance(m.get("content"), str)
                    else m for m in messages]
    flatten = None if reads_content_parts(template.text) else lambda ms: flatten_parts(ms, placeholder)
    # A processor that puts a text before every prompt (Janus's default system prompt) does it after the template,
    # and looks for the BOS text in the template's rendering.
    prefix, bos = vision.get("prompt_prefix") or "", template.specials.get("bos_token")
    finish = processor_ids(tokenizer.encode, bos)
    return conversation_ids(lambda ms: prefix + render(ms), messages, tokenizer, images_around(vision, encode),
                            special_tokens_in_content, keep_as_text=(placeholder,), flatten=flatten,
                            finish=lambda text, ids: finish(text[len(prefix):], ids))
