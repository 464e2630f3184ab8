"""OpenAI chat messages → the dicts chat templates read: roles checked, text parts joined, tool calls checked.

Every field a message may carry is read or refused (a 400 naming it), never dropped: system, developer and user
messages carry content and a name; assistant messages also `tool_calls` (content may then be null: it reads as
empty) and the previous turn's reasoning (`reasoning_content`, or vLLM's newer `reasoning`); tool messages the
`tool_call_id` they answer.
"""

from __future__ import annotations

from typing import Any

from jengine.errors import InvalidRequestError
from jengine.tokenizer.chat import join_text_parts, template_tool_calls
from server.json_body import json_type

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_ROLE_KEYS = {"assistant": frozenset({"tool_calls", "reasoning", "reasoning_content"}),
              "tool": frozenset({"tool_call_id"})}  # beyond _MESSAGE_KEYS


def _string(message: dict[str, Any], key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string, got {json_type(value)}", param=f"{where}.{key}")
    return value


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages → [{"role", "content"[, "name"]}] with text parts joined (assistants' also `tool_calls` and
    `reasoning_content`, tool results' `tool_call_id`); other content is a 400."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty array of messages", param="messages")
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object, got {json_type(message)}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(sorted(ROLES))}", param=f"{where}.role")
    allowed = _MESSAGE_KEYS | _ROLE_KEYS.get(role, frozenset())
    for key, value in message.items():
        # null (or an empty tool_calls list) asks for nothing: what the client's own response messages carry
        if key not in allowed and value is not None and not (key == "tool_calls" and value == []):
            raise InvalidRequestError(f"{where}.{str(key)[:40]} is not supported in a {role} message",
                                      param=f"{where}.{str(key)[:40]}")
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    # an assistant's null content beside its calls reads as empty: templates join content as a string
    out: dict[str, Any] = {"role": role, "content": "" if content is None and tool_calls else
                           _content(content, where)}
    for key in ("name", "tool_call_id"):
        value = _string(message, key, where)
        if value is not None:
            out[key] = value
    if role == "tool" and "tool_call_id" not in out:
        raise InvalidRequestError(f"{where}.tool_call_id is required in a tool message", param=f"{where}.tool_call_id")
    if tool_calls:
        template_tool_calls(tool_calls, where)  # checked here for the 400; rendering parses the arguments
        out["tool_calls"] = tool_calls
    reasoning = _string(message, "reasoning_content", where) or _string(message, "reasoning", where)
    if reasoning is not None and role == "assistant":
        out["reasoning_content"] = reasoning  # the name templates (Qwen3's) read
    return out


def _content(content: Any, where: str) -> str:
    """A string, or an array of {"type": "text", "text": ...} parts joined by newlines (this model reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or an array of text parts, got "
                                  f"{json_type(content)}", param=f"{where}.content")
    return join_text_parts(content, where)
