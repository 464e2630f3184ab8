"""How a chat request's reply is planned to be read: the tool choice, the server's flags and structured output."""

from __future__ import annotations

import pytest

from jengine.clients.protocol import ModelInfo
from jengine.config import ChatParsingConfig
from jengine.errors import InvalidRequestError
from jengine.tools.parsers import FORCED
from jengine.tools.request import ChatParsing, ToolRequest, parse_tools
from server.openai.protocol import parse_chat

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "hi"}]
R1_HERMES = ChatParsingConfig("deepseek_r1", "hermes", True)


def _parsing(config: ChatParsingConfig, **body: object) -> ChatParsing | None:
    return parse_chat({"messages": MESSAGES, **body}, ModelInfo("m", "/m", 256, 1000, 20, chat_parsing=config)).parsing


def test_the_plan_follows_the_tool_choice() -> None:
    assert _parsing(R1_HERMES, tools=TOOLS) == ChatParsing("deepseek_r1", "hermes")
    assert _parsing(R1_HERMES, tools=TOOLS, tool_choice="none") == ChatParsing("deepseek_r1")
    assert _parsing(R1_HERMES, tools=TOOLS, parallel_tool_calls=False) == ChatParsing("deepseek_r1", "hermes", 1)
    assert _parsing(ChatParsingConfig(), tools=TOOLS, tool_choice="none") is None
    # forced choices: a grammar makes the reply calls, after the reasoning span when the server reads one
    assert _parsing(R1_HERMES, tools=TOOLS, tool_choice="required") == ChatParsing("deepseek_r1", FORCED,
                                                                                   constrained=True)
    assert _parsing(ChatParsingConfig(), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}
                    ) == ChatParsing(None, FORCED, constrained=True)


def test_a_constrained_reply_is_read_for_reasoning_first() -> None:
    assert _parsing(R1_HERMES, response_format={"type": "json_object"}) == ChatParsing("deepseek_r1",
                                                                                       constrained=True)
    assert _parsing(ChatParsingConfig(), response_format={"type": "json_object"}) is None
    qwen3 = ChatParsing("qwen3", constrained=True)
    # the grammar waits for </think> (the reply is read as starting in reasoning) unless the prompt closed the span
    assert qwen3.read("<|im_start|>assistant\n", 'plan</think>{"a":1}').reasoning == "plan"
    thinking_off = qwen3.read("<|im_start|>assistant\n<think>\n\n</think>\n\n", '{"a":1}')
    assert (thinking_off.content, thinking_off.reasoning) == ('{"a":1}', None)
    assert ChatParsing("qwen3").read("<|im_start|>assistant\n", "plain").content == "plain"  # free: as before


def test_tools_are_checked_field_by_field() -> None:
    for tools, choice, param in [("x", None, "tools"), ([{"type": "function", "function": {"name": ""}}], None,
                                                        "tools[0].function.name"),
                                 (TOOLS + TOOLS, None, "tools[1].function.name"),
                                 ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
                                  "tools[0].function.parameters"),
                                 (TOOLS, {"type": "function"}, "tool_choice")]:
        with pytest.raises(InvalidRequestError) as info:
            parse_tools(tools, choice)
        assert info.value.param == param
    assert parse_tools(None, "auto") == ToolRequest((), "auto")  # nothing to call: read as written
    assert parse_tools(None, None) is None
