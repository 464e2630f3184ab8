"""The tool-calling and reasoning parts of `jengine.v1`, both ways: messages' tool fields, a chat's tools and tool
choice, the read deltas of a reply (`ChatDelta`), and how the engine reads chat replies (in its model info).

JSON-valued fields (tool calls, tools) travel as JSON text, as OpenAI's own `arguments` do; they are checked by the
same functions as over HTTP (`server.openai.messages`, `jengine.tools.request`), so a request is refused alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jengine.config import ChatParsingConfig
from jengine.errors import InvalidRequestError
from jengine.outputs import CompletionOutput
from jengine.sampling.params import SamplingParams
from jengine.tools.request import ChatParsing, ToolRequest, parse_tools, with_forced_calls
from jengine.tools.stream import ChoiceParsers, MessageDelta
from jengine.v1 import jengine_pb2 as pb

MESSAGE_TOOL_KEYS = ("tool_calls", "tool_call_id", "reasoning_content")


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{field} is not JSON: {exc}"[:200], param=field) from None


def _to_json(value: Any, field: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{field} must be JSON values: {exc}"[:200], param=field) from None


def message_tool_fields(msg: pb.ChatMessage) -> dict[str, Any]:
    """The tool fields a ChatMessage carries, as the message dict holds them (only those set)."""
    fields: dict[str, Any] = {}
    if msg.tool_calls_json:
        fields["tool_calls"] = _json(msg.tool_calls_json, "tool_calls_json")
    if msg.tool_call_id:
        fields["tool_call_id"] = msg.tool_call_id
    if msg.reasoning_content:
        fields["reasoning_content"] = msg.reasoning_content
    return fields


def fill_message_tool_fields(msg: pb.ChatMessage, message: Mapping[str, Any]) -> None:
    if message.get("tool_calls"):
        msg.tool_calls_json = _to_json(list(message["tool_calls"]), "tool_calls")
    for key in ("tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise InvalidRequestError(f"message {key} must be a string", param="messages")
            setattr(msg, key, message[key])


def tools_from_proto(chat: pb.ChatMessages) -> ToolRequest | None:
    """The chat's tools and tool choice, checked as over HTTP."""
    tools = _json(chat.tools_json, "tools_json") if chat.tools_json else None
    kind = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    choice: Any = None
    if kind == "mode":
        choice = chat.tool_choice.mode
    elif kind == "function_name":
        choice = {"type": "function", "function": {"name": chat.tool_choice.function_name}}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    return parse_tools(tools, choice, parallel)


def chat_parsing(request: pb.GenerateRequest, config: ChatParsingConfig, params: SamplingParams
                 ) -> tuple[ChatParsing | None, SamplingParams]:
    """How a Generate request's reply is read (None: not a chat, or nothing to read), and its params: constrained
    to calls for a forced tool choice, special tokens kept where the tool format's markers are special tokens (as
    over HTTP)."""
    if request.WhichOneof("prompt") != "messages":
        return None, params
    tools = tools_from_proto(request.messages)
    parsing = ChatParsing.plan(config, tools, constrained=params.structured_outputs is not None)
    params = with_forced_calls(params, tools)
    if parsing is not None:
        params = params.clone(structured_outputs=parsing.structured(params.structured_outputs))
    if parsing is not None and parsing.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return parsing, params


def tools_option(chat: pb.ChatMessages) -> dict[str, Any]:
    """The chat prompt dict's `tools` (what the template lists), when the chat has any."""
    return {"tools": _json(chat.tools_json, "tools_json")} if chat.tools_json else {}


def fill_tools(chat: pb.ChatMessages, tools: Any) -> None:
    """Tools for the template only: the choice is "none", since whoever sent them reads the reply itself."""
    if tools:
        chat.tools_json = _to_json(list(tools), "tools")
        chat.tool_choice.mode = "none"


def chat_delta_to_proto(delta: MessageDelta, finish_reason: str | None) -> pb.ChatDelta:
    msg = pb.ChatDelta(content=delta.content, reasoning=delta.reasoning, finish_reason=finish_reason or "")
    for call in delta.tool_calls:
        msg.tool_calls.append(pb.ToolCallDelta(index=call.index, id=call.id or "", name=call.name or "",
                                               arguments=call.arguments))
    return msg


class ChatReader:
    """Server side of one stream: each choice's text read by the request's parsers, delta by delta."""

    def __init__(self, parsing: ChatParsing) -> None:
        self._parsers = ChoiceParsers(parsing.choice)

    def read(self, choice: CompletionOutput, prompt: str | None) -> pb.ChatDelta:
        return chat_delta_to_proto(*self._parsers.feed(choice.index, prompt, choice.text, choice.finish_reason))


def chat_parsing_fields(config: ChatParsingConfig) -> dict[str, Any]:
    """GetModelInfoResponse's fields for the engine's ChatParsingConfig."""
    return {"reasoning_parser": config.reasoning_parser or "", "tool_call_parser": config.tool_call_parser or "",
            "enable_auto_tool_choice": config.enable_auto_tool_choice}


def chat_parsing_from_proto(msg: pb.GetModelInfoResponse) -> ChatParsingConfig:
    return ChatParsingConfig(msg.reasoning_parser or None, msg.tool_call_parser or None, msg.enable_auto_tool_choice)
