"""`LLM.chat` with tools and the reasoning/tool-call parsers, over a fake core that writes a scripted reply."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jengine.config import ChatParsingConfig
from jengine.llm import LLM
from jengine.outputs import ChatMessage
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

from tests.engine.conftest import FakeCore, make_parts

REPLY = ('<think>Paris weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEMPLATE = ("{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"}]


def _llm(tokenizer: Tokenizer, parsing: ChatParsingConfig) -> LLM:
    reply = tokenizer.encode(REPLY, add_special_tokens=False)
    parts = make_parts(tokenizer, FakeCore(script=lambda request, index: reply + [tokenizer.eos_token_id]),
                       max_model_len=512)
    return LLM.from_parts(dataclasses.replace(parts, config=dataclasses.replace(parts.config,
                                                                                chat_parsing=parsing)))


def test_chat_reads_tool_calls_and_reasoning(tokenizer: Tokenizer) -> None:
    llm = _llm(tokenizer, ChatParsingConfig("qwen3", "hermes"))
    [result] = llm.chat(CONVERSATION, SamplingParams(max_tokens=200), chat_template=TEMPLATE, tools=TOOLS,
                        use_tqdm=False)
    assert result.prompt.startswith("[get_weather]user: Weather in Paris?")  # the template listed the tools
    output = result.outputs[0]
    assert output.text == REPLY and output.finish_reason == "tool_calls"
    message = output.message
    assert (message.content, message.reasoning) == (None, "Paris weather.")
    [call] = message.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_without_parsers_the_tools_only_reach_the_template(tokenizer: Tokenizer) -> None:
    llm = _llm(tokenizer, ChatParsingConfig())
    [result] = llm.chat(CONVERSATION, SamplingParams(max_tokens=200), chat_template=TEMPLATE, tools=TOOLS,
                        use_tqdm=False)
    assert result.prompt.startswith("[get_weather]") and result.outputs[0].message is None
    assert result.outputs[0].finish_reason == "stop"
    parsed = _llm(tokenizer, ChatParsingConfig(None, "hermes")).chat(
        CONVERSATION, SamplingParams(max_tokens=200), chat_template=TEMPLATE, tools=TOOLS, tool_choice="none",
        use_tqdm=False)
    assert parsed[0].outputs[0].message is None  # "none": calls are not read
    reasoning_only = _llm(tokenizer, ChatParsingConfig("deepseek_r1")).chat(
        CONVERSATION, SamplingParams(max_tokens=200), chat_template=TEMPLATE, use_tqdm=False)
    assert reasoning_only[0].outputs[0].message == ChatMessage(REPLY.split("</think>\n")[1], "Paris weather.")


def test_a_forced_tool_choice_constrains_and_reads_calls(tokenizer: Tokenizer) -> None:
    """tool_choice "required": the request carries the calls' grammar, and the reply (here scripted as the grammar
    would make it) is read into calls, whatever the parser flags."""
    reply = tokenizer.encode('[{"name":"get_weather","parameters":{"city":"Paris"}}]', add_special_tokens=False)
    constraints = []

    def script(request: Any, index: int) -> list[int]:
        constraints.append(request.sampling_params.structured_outputs)
        return reply + [tokenizer.eos_token_id]

    llm = LLM.from_parts(make_parts(tokenizer, FakeCore(script=script), max_model_len=512))
    [result] = llm.chat(CONVERSATION, SamplingParams(max_tokens=200), chat_template=TEMPLATE, tools=TOOLS,
                        tool_choice="required", use_tqdm=False)
    [call] = result.outputs[0].message.tool_calls
    assert (call.name, json.loads(call.arguments), result.outputs[0].finish_reason) == (
        "get_weather", {"city": "Paris"}, "tool_calls")
    assert result.outputs[0].message.content is None
    [constraint] = constraints
    assert constraint.json["type"] == "array" and constraint.json["items"]["properties"]["name"] == {
        "type": "string", "enum": ["get_weather"]}
