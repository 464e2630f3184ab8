"""The chat module owns the chat checks: each one gives the same error from every front end that meets it."""

from __future__ import annotations

import pytest

from jengine.clients.protocol import ModelInfo
from jengine.errors import InvalidRequestError
from jengine.tokenizer import Tokenizer
from jengine.tokenizer.chat import render_chat
from server.grpc_convert import messages_to_proto
from server.openai.protocol import parse_chat

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]


def test_continuing_a_message_under_a_new_turn_is_one_error_everywhere(tokenizer: Tokenizer) -> None:
    """continue_final_message with add_generation_prompt: the same 400 from the HTTP parser, the gRPC client (before
    anything is sent), the engine's chat prompts and the tokenizer's apply_chat_template."""
    info = ModelInfo("m", "/models/m", 256, tokenizer.vocab_size, 20)
    refusals = [
        lambda: parse_chat({"messages": MESSAGES, "continue_final_message": True}, info),
        lambda: messages_to_proto(MESSAGES, True, True),
        lambda: render_chat(tokenizer, MESSAGES, {"continue_final_message": True}),
        lambda: tokenizer.apply_chat_template(MESSAGES, continue_final_message=True),
    ]
    errors = set()
    for refuse in refusals:
        with pytest.raises(InvalidRequestError) as info_:
            refuse()
        errors.add((str(info_.value), info_.value.param))
    assert len(errors) == 1
    message, param = errors.pop()
    assert param == "continue_final_message" and "add_generation_prompt" in message
