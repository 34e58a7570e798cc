"""Chat messages checked once for the Python API and the server (issue 43, 10 and 11): text-part lists
joined, unknown keys refused by name (in a message and in a text part), a tool message answering a call
nobody made refused, OpenAI's `developer` role taken as system."""

from __future__ import annotations

import pytest

from kvforge.core.errors import InputError
from kvforge.runtime.text.messages import MessageKeyError, check_messages

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}


def test_text_parts_are_joined_and_developer_is_system() -> None:
    checked = check_messages([{"role": "developer", "content": "Be brief."},
                              {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert checked == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize(("messages", "error", "says"), [
    ([{"role": "user", "content": "hi", "zzz": 1}], MessageKeyError,
     "messages[0] has the key 'zzz', which a user message does not take here; it takes content, name, role"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}], MessageKeyError,
     "messages[0].content[0] has the key 'cache_control', which a text part does not take"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], InputError,
     "messages[0].content[0] is a 'image_url' part; text parts only"),
    ([{"role": "assistant", "content": "x", "refusal": "no"}], MessageKeyError,
     "messages[0].refusal is not supported (it would be ignored); leave it out or null; send a refusal's text"),
    ([CALL, {"role": "tool", "content": "2", "tool_call_id": "c9"}], InputError,
     "message 1 answers tool_call_id 'c9', which no earlier assistant message's tool_calls has"),
    ([{"role": "tool", "content": "2", "tool_call_id": "c1"}, CALL], InputError,
     "message 0 answers tool_call_id 'c1'"),  # the call comes after its answer
    ([{"role": "wizard", "content": "x"}], InputError, "message 0 has role 'wizard'; use one of system, user"),
], ids=["message key", "text part key", "image part", "refusal", "unmatched call id", "answer before call",
        "role"])
def test_what_is_refused_is_named(messages, error, says) -> None:
    with pytest.raises(error) as caught:
        check_messages(messages)
    assert says in str(caught.value)


def test_a_tool_answer_to_an_earlier_call_and_null_only_keys_pass() -> None:
    checked = check_messages([{"role": "user", "content": "add"}, CALL,
                              {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "add"},
                              {"role": "assistant", "content": "2", "refusal": None, "audio": None}])
    assert checked[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and checked[1]["content"] == ""
    assert checked[2]["tool_call_id"] == "c1"
