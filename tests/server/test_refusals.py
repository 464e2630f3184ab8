"""Every refused request field is named and the reason said in words; the value is never dumped into the message."""

from __future__ import annotations

import pytest

from jengine.errors import InvalidRequestError
from server.openai.protocol import CHAT_FIELDS, check_fields, normalize_messages

LONG_FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
REFUSED = {"functions": LONG_FUNCTIONS, "function_call": {"name": "get_weather"}, "best_of": 3,
           "truncate_prompt_tokens": 5, "audio": {"voice": "x"}, "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "x"}, "logits_processors": ["a.b"]}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_named_with_its_reason(name: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check_fields({name: REFUSED[name]}, CHAT_FIELDS)
    message = str(raised.value)
    head, _, why = message.partition(": ")
    assert head == f"{name} is not supported by this server" and raised.value.param == name
    assert len(why.split()) >= 2 and not any(c in message for c in "{}[]"), message  # words, no JSON dump


def test_an_unknown_message_key_is_named_whole() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        normalize_messages([{"role": "user", "content": "hi", "function_call_arguments_payload": {"a": 1}}])
    message = str(raised.value)
    assert message.startswith("messages[0].function_call_arguments_payload is not supported in a user message: ")
    assert "{" not in message
