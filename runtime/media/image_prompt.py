"""Where an image's features go among a prompt's token ids (the manifest's `vision` record, exporter/vision.py).

A caller marks each image's place with the family's placeholder text ("<image>") in a text prompt, or with one
image token id in a token-id prompt. Each mark becomes the family's ids before an image, one image token per image
feature (`tokens_per_image`) and the ids after it, as the family's Hugging Face processor expands it; the prefill
graph writes the image's features over those image tokens (contract.IMAGE_FEATURES).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from kvforge.core.errors import InputError


def text_with_images(text: str, vision: dict[str, Any], encode: Callable[[str, bool], list[int]]) -> list[int]:
    """A text prompt's ids with one image token id at each placeholder (the text between placeholders tokenized
    piece by piece, the first with the tokenizer's special tokens, as a processor's added image token splits it), and
    one video token id at each video placeholder of a family that takes videos (vision.video).
    (expand_images puts the images of a prompt without a placeholder before its text.)"""
    marks = media_marks(vision)
    pieces = re.split("(" + "|".join(re.escape(place) for place in marks) + ")", text)
    texts, places = pieces[0::2], pieces[1::2]
    before, after = vision.get("text_before") or "", vision.get("text_after") or ""
    if before or after:  # text the processor writes around each image and tokenizes with the prompt (Gemma 3's)
        last = len(texts) - 1
        texts = [(after if i else "") + piece + (before if i < last else "") for i, piece in enumerate(texts)]
    ids = encode(texts[0], True)
    for place, piece in zip(places, texts[1:], strict=True):
        ids.append(marks[place])
        if piece:
            ids.extend(encode(piece, False))
    return ids


def media_marks(vision: dict[str, Any]) -> dict[str, int]:
    """{placeholder text: the id that marks its place}: the image placeholder, and a family's video placeholder."""
    marks = {vision["placeholder"]: vision["image_token_id"]}
    if vision.get("video") is not None:
        marks[vision["video_placeholder"]] = vision["mrope"]["video_token_id"]
    return marks


def images_around(vision: dict[str, Any], encode: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """`encode` (a rendered chat's text, no special tokens added) with one image token id at each of the family's
    chat placeholders (chat_placeholder: what its chat templates write for an image part)."""
    chat = {**vision, "placeholder": chat_placeholder(vision),
            **({"video_placeholder": vision["video_chat_placeholder"]} if vision.get("video") is not None else {})}
    return lambda text: text_with_images(text, chat, lambda piece, _: encode(piece))


def chat_placeholder(vision: dict[str, Any]) -> str:
    """The text the family's chat templates write for an image part (the processor's image token); exports made
    before the manifest recorded it use the prompt placeholder."""
    return vision.get("chat_placeholder") or vision["placeholder"]


def expand_images(ids: list[int], images: int | Sequence[int], vision: dict[str, Any], where: str,
                  runs: Sequence[Sequence[int] | None] | None = None, marks: Sequence[int] | None = None) -> list[int]:
    """`ids` with each image token replaced by an image's run (before_ids, its image tokens, after_ids): `images`
    is how many images (each `tokens_per_image` tokens) or each image's token count (a family whose images take
    tokens by their size); `runs`: each image's whole run instead (a tiled family's, runtime/media/tiling.py, or a
    video's). `marks`: the id that marks each one's place (a video's is the video token; default the image token).
    A prompt with no mark and images gets them at its start (after a leading BOS)."""
    counts = [vision["tokens_per_image"]] * images if isinstance(images, int) else list(images)
    token = vision["image_token_id"]
    marks = list(marks) if marks is not None else [token] * len(counts)
    kinds = set(marks) | {token}
    placed = [i for i in ids if i in kinds]
    if not placed and counts:
        start = 1 if ids and ids[0] == vision.get("bos_token_id") else 0
        ids, placed = ids[:start] + marks + ids[start:], marks
    if len(placed) != len(counts):
        raise InputError(f"{where} marks {len(placed)} image place(s) ({vision['placeholder']!r}) but comes with "
                         f"{len(counts)} image(s): give one image per place")
    if placed != marks:
        raise InputError(f"{where} marks its image and video places in another order than the images and videos "
                         "given: give them in the order of their places")
    made = [list(run) if runs is not None and run is not None
            else [*vision["before_ids"], *[token] * count, *vision["after_ids"]]
            for count, run in zip(counts, runs or [None] * len(counts), strict=True)]
    out: list[int] = []
    each = iter(made)
    for i in ids:
        out.extend(next(each) if i in kinds else (i,))
    return out


def image_key(ids: list[int], digests: list[str], vision: dict[str, Any],
              counts: Sequence[int] | None = None) -> list[int]:
    """Expanded `ids` as a cached prefix's key: the k-th image token replaced by an id drawn from its image's
    digest (negative, so never a real token), so two prompts share a prefix only where their images are the same
    image. `counts`: each image's token count (default: tokens_per_image each)."""
    token = vision["image_token_id"]
    owners = [d for digest, n in zip(digests, counts or [vision["tokens_per_image"]] * len(digests), strict=True)
              for d in [digest] * n]
    key, seen = [], 0
    for i in ids:
        if i == token and owners:
            key.append(-1 - int(owners[min(seen, len(owners) - 1)][:15], 16))
            seen += 1
        else:
            key.append(i)
    return key


IMAGE_PARTS = ("image_url", "image", "video")


def take_image_parts(messages: Any) -> tuple[Any, list[Any]]:
    """Messages with each image content part ({"type": "image_url", "image_url": {"url": ...}}, OpenAI's; or
    {"type": "image", "image": source}) replaced by {"type": "image"}, as transformers' processors pass a template
    the parts (the template writes the image's place), and the images in order. Messages without image parts come
    back as they were, with no images."""
    if not isinstance(messages, list):
        return messages, []
    images: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PARTS:
                parts.append(part)
                continue
            if kind == "video":  # kvforge's frame list (runtime/media/video.py)
                images.append(video_part(part.get("video"), f"messages[{i}].content[{j}]"))
                parts.append({"type": "video"})
                continue
            source = part.get("image_url") if kind == "image_url" else part.get("image")
            if kind == "image_url":
                source = source.get("url") if isinstance(source, dict) else source
                if not isinstance(source, str):
                    raise InputError(f"messages[{i}].content[{j}].image_url must hold a 'url' string")
            if source is None:
                raise InputError(f"messages[{i}].content[{j}] is an image part without an image")
            images.append(source)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def video_part(video: Any, where: str) -> Any:
    """A video content part's value as a Video: {"frames": [...], "fps": number} (or a Video as it is)."""
    from kvforge.runtime.media.video import Video

    if isinstance(video, Video):
        return video
    if not isinstance(video, dict) or not isinstance(video.get("frames"), list | tuple):
        raise InputError(f"{where} is a video part without a frame list ({{'frames': [...], 'fps': number}})")
    return Video(tuple(video["frames"]), video.get("fps"))


def flatten_parts(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """Messages for a template that writes `content` as one string (a text template on a vision export): each
    content list joined by newlines, an image part as `placeholder`."""
    return [dict(m, content="\n".join(placeholder if part.get("type") in ("image", "video") else part["text"]
                                      for part in m["content"])) if isinstance(m.get("content"), list) else m
            for m in messages]


def special_ids(encode: Callable[[str, bool], list[int]]) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor adds before and after a text (Llama's BOS: ([1], []))."""
    plain, full = encode("a", False), encode("a", True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


def processor_ids(encode: Callable[[str, bool], list[int]],
                  bos_text: str | None) -> Callable[[str, list[int]], list[int]]:
    """(rendered text, its ids) -> the ids transformers' processor makes of it: its apply_chat_template(tokenize=True)
    tokenizes the rendering with the tokenizer's special tokens (BOS) unless the rendering starts with the BOS text."""
    before, after = special_ids(encode)
    return lambda text, ids: ids if bos_text and text.startswith(bos_text) else [*before, *ids, *after]


def check_image_places(ids: list[int], images: list[Any], vision: dict[str, Any], source: str) -> None:
    """InputError unless the rendered conversation holds one image place per image part (a template that writes
    no place for an image part, such as one that drops a system message's images, would lose the image)."""
    places = sum(ids.count(mark) for mark in media_marks(vision).values())
    if places != len(images):
        raise InputError(f"{source} wrote {places} image place(s) ({chat_placeholder(vision)!r}) for the "
                         f"conversation's {len(images)} image part(s): put the images in messages whose images the "
                         "template writes (user messages)")
