"""Chat messages as the template gets them, checked once for the Python API (`Generator.chat`) and the
server alike, so that both accept and refuse the same messages: OpenAI's shapes (a str or a list of
text parts as content, `tool_calls`, `tool_call_id`, `name`, the `developer` role), every other key
refused by name rather than dropped without a word."""

from __future__ import annotations

import json
from typing import Any

from kvforge.core.errors import InputError

ROLES = ("system", "user", "assistant", "tool")
# What each role's message may carry (OpenAI's chat API). Used: role, content, tool_calls (assistant),
# tool_call_id (tool) and name (OpenAI's participant name: used when the chat template writes it,
# refused when it does not, runtime/service.py; a tool message's name is only a label). Accepted only
# when null or absent: an assistant's `refusal` and `audio`, and the deprecated `function_call` (a
# refusal's text goes in the content).
MESSAGE_KEYS = {"system": {"role", "content", "name"}, "user": {"role", "content", "name"},
                "tool": {"role", "content", "tool_call_id", "name"},
                "assistant": {"role", "content", "name", "tool_calls"}}
MESSAGE_KEYS["developer"] = MESSAGE_KEYS["system"]  # OpenAI's current name for the system role
NULL_ONLY_MESSAGE_KEYS = {"assistant": {"refusal", "audio", "function_call"}}


class MessageKeyError(InputError):
    """A message key this code does not take (the server answers it as an unsupported parameter)."""


def check_messages(messages: Any, keep_images: bool = False, content_parts: bool = False) -> list[dict[str, Any]]:
    """Messages as the template gets them: {role, content} with str content (a list of OpenAI text
    parts is joined by newlines); an assistant message may carry `tool_calls` instead of content
    (content null or absent), a tool message the `tool_call_id` of an earlier call, any message a
    `name`. A call's `arguments` (OpenAI sends a JSON string) reach the template as the object, which
    is what templates write with `tojson`. `keep_images` (the server's first check): a content list (OpenAI's
    image_url parts checked, in a message of any role as transformers takes them) is kept as a list, for a
    vision-language export's template and images (runtime/media/image_prompt.py take_image_parts). `content_parts` (a
    vision-language export's chat, after take_image_parts): a content list stays a list of text parts and
    {"type": "image"} parts, which is what transformers' processors pass the template."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts (or one str)")
    out, call_ids = [], set()
    for i, message in enumerate(messages):
        checked = _check_message(message, i, keep_images, content_parts)
        if "tool_calls" in checked:
            call_ids.update(call["id"] for call in checked["tool_calls"] if call.get("id") is not None)
        answered = checked.get("tool_call_id") if checked["role"] == "tool" else None
        if answered is not None and answered not in call_ids:
            raise InputError(f"message {i} answers tool_call_id {answered!r}, which no earlier assistant message's "
                             "tool_calls has; a tool message answers a call made before it"[:400])
        out.append(checked)
    return out


def _check_message(message: Any, i: int, keep_images: bool = False, content_parts: bool = False) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InputError(f"message {i} must be a dict with str 'role' and 'content', got {message!r}"[:500])
    role = message["role"]
    if role not in MESSAGE_KEYS:
        raise InputError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)} (or 'developer', "
                         "OpenAI's name for system)"[:400])
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise InputError(f"message {i} has 'tool_calls' but role {role!r}; only assistant messages carry tool calls")
    _check_keys(message, i)
    content = message.get("content")
    if keep_images and isinstance(content, list):  # the parts are kept for a vision export's template
        if not _image_parts(content, i):
            _content_text(content, i)  # its text parts checked now
        return dict(message, content=content)
    content = _content_parts(content, i) if content_parts else _content_text(content, i)
    if calls is not None and content is None and role == "assistant":
        content = ""  # OpenAI's null content beside tool calls; templates test it for truth
    if not isinstance(content, str) and not (content_parts and isinstance(content, list)):
        raise InputError(f"message {i} must be a dict with str 'role' and 'content', got {message!r}"[:500])
    checked = dict(message, role="system" if role == "developer" else role, content=content)
    for key in ("tool_call_id", "name"):
        if checked.get(key) is not None and not isinstance(checked[key], str):
            raise InputError(f"message {i}'s {key!r} must be a str, got {checked[key]!r}"[:300])
    if calls is not None:
        checked["tool_calls"] = _check_tool_calls(calls, i)
    return checked


def _check_keys(message: dict[str, Any], i: int) -> None:
    role = message["role"]
    for key, value in message.items():
        if key in MESSAGE_KEYS[role] or (key in NULL_ONLY_MESSAGE_KEYS.get(role, ()) and value is None):
            continue
        if key in NULL_ONLY_MESSAGE_KEYS.get(role, ()):
            raise MessageKeyError(f"messages[{i}].{key} is not supported (it would be ignored); leave it out or "
                                  "null" + ("; send a refusal's text as the content" if key == "refusal" else ""))
        raise MessageKeyError(f"messages[{i}] has the key {key!r}, which a {role} message does not take here; it "
                              f"takes {', '.join(sorted(MESSAGE_KEYS[role]))}"[:400])


IMAGE_PART_KEYS = {"url", "detail"}


def _image_parts(content: Any, i: int) -> bool:
    """Whether `content` is a list with OpenAI image_url parts (each checked: {"type": "image_url", "image_url":
    {"url": str, ["detail"]}}) or kvforge's video parts ({"type": "video", "video": {"frames": [url, ...],
    ["fps": number]}}: OpenAI's format has none); its text parts are checked later, by _content_text."""
    if not isinstance(content, list):
        return False
    found = False
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "video":
            video = part.get("video")
            if set(part) != {"type", "video"} or not isinstance(video, dict) or set(video) - {"frames", "fps"} \
                    or not isinstance(video.get("frames"), list) or not all(isinstance(f, str) for f in video["frames"]):
                raise InputError(f"messages[{i}].content[{j}] must be {{'type': 'video', 'video': {{'frames': [url, "
                                 "...], 'fps': number}}}} (each frame a data:image URL)")
            found = True
            continue
        if kind != "image_url":
            continue
        image = part.get("image_url")
        if set(part) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str) \
                or set(image) - IMAGE_PART_KEYS:
            raise InputError(f"messages[{i}].content[{j}] must be {{'type': 'image_url', 'image_url': {{'url': ...}}}}")
        found = True
    return found


def _content_text(content: Any, i: int) -> Any:
    """OpenAI's content forms: a str, or a list of parts of which only text parts are taken (joined by
    newlines); other parts, and unknown keys inside a text part, are refused by name."""
    if not isinstance(content, list):
        return content
    return "\n".join(_text_part(part, i, j) for j, part in enumerate(content))


def _text_part(part: Any, i: int, j: int) -> str:
    """The text of messages[i].content[j], which must be a text part (anything else refused by name)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text" or not isinstance(part.get("text"), str):
        shown = repr(kind) if kind is not None else f"{type(part).__name__} {part!r}"[:80]
        raise InputError(f"messages[{i}].content[{j}] is a {shown} part; text parts only are taken "
                         "({'type': 'text', 'text': ...})")
    unknown = sorted(set(part) - {"type", "text"})
    if unknown:
        raise MessageKeyError(f"messages[{i}].content[{j}] has the key {unknown[0]!r}, which a text part does "
                              "not take; it takes text, type"[:400])
    return part["text"]


def _content_parts(content: Any, i: int) -> Any:
    """A content list as a list of checked parts: text parts ({"type": "text", "text": str}) and image places
    ({"type": "image"} or {"type": "video"}, what take_image_parts leaves of a media part); a str (or None) as it
    is."""
    if not isinstance(content, list):
        return content
    return [part if part in ({"type": "image"}, {"type": "video"}) else {"type": "text", "text": _text_part(part, i, j)}
            for j, part in enumerate(content)]


def message_text(content: Any) -> str:
    """The text a message's content holds (a str, or its text parts joined by newlines), for length checks."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content if isinstance(content, str) else ""


def _check_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InputError(f"message {i}'s 'tool_calls' must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        where = f"message {i}'s tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or call.get("type", "function") != "function":
            raise InputError(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': "
                             f"str}}}}, got {call!r}"[:500])
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise InputError(f"{where}'s 'id' must be a str, got {call['id']!r}"[:300])
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as err:
                raise InputError(f"{where}'s arguments are not valid JSON ({err}): {arguments!r}"[:500]) from None
        if not isinstance(arguments, dict):
            raise InputError(f"{where}'s arguments must be a JSON object, got {arguments!r}"[:300])
        out.append(dict(call, type="function", function=dict(function, arguments=arguments)))
    return out
