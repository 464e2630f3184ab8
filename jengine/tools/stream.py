"""One chat choice's text read by its reasoning and tool-call parsers, as OpenAI deltas while it streams and as a
`ChatMessage` once it is whole.

Each new piece of text is appended and the whole is read again (`scan` readings only grow, and the parsers resume
their scans), so what is sent is the growth of the reading: new reasoning, new content, a new call (index, id, name,
its arguments so far), or more of a call's arguments. The non-streamed message is the final reading of the same
text: a stream reassembles to it exactly, whatever the split.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from jengine.outputs import ChatMessage, ToolCall
from jengine.tools.parsers.base import PartialCall, ToolParser
from jengine.tools.reasoning.think import ReasoningParser

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's streamed call: the first delta of a call has its id and name, later ones more arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
            function = {"name": self.name, **function}
        return out | {"function": function}


@dataclasses.dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclasses.dataclass
class _Reading:
    reasoning: str = ""
    content: str = ""
    calls: list[PartialCall] = dataclasses.field(default_factory=list)


class ChoiceParser:
    """The text of one choice so far and what of its reading has been sent."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None
                 ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls are dropped
        self._text = ""
        self._sent = _Reading()
        self._ids: list[str] = []

    def feed(self, text: str, final: bool = False) -> MessageDelta:
        """Append `text` and return what the reading gained; `final` once the choice has ended."""
        self._text += text
        reading = self._read(final)
        delta = MessageDelta(content=_growth(self._sent.content, reading.content, "content"),
                             reasoning=_growth(self._sent.reasoning, reading.reasoning, "reasoning"))
        for index, call in enumerate(reading.calls):
            if index >= len(self._sent.calls):
                assert self._tools is not None
                self._ids.append(self._tools.new_call_id())
                delta.tool_calls.append(ToolCallDelta(index, self._ids[index], call.name, call.arguments))
            else:
                grown = _growth(self._sent.calls[index].arguments, call.arguments, "arguments")
                if grown:
                    delta.tool_calls.append(ToolCallDelta(index, arguments=grown))
        self._sent = reading
        return delta

    def message(self) -> ChatMessage:
        """The message of everything read so far (the whole message after a `final` feed)."""
        calls = tuple(ToolCall(self._ids[i], c.name, c.arguments) for i, c in enumerate(self._sent.calls))
        return ChatMessage(self._sent.content or None, self._sent.reasoning or None, calls)

    def _read(self, final: bool) -> _Reading:
        reading = _Reading(content=self._text)
        if self._reasoning is not None:
            scan = self._reasoning.scan(self._text, final)
            reading.reasoning, reading.content = scan.reasoning, scan.content
        if self._tools is not None:
            tools = self._tools.scan(reading.content, final)
            reading.content, reading.calls = tools.content, tools.calls[:self._max_calls]
        return reading


def _growth(sent: str, now: str, what: str) -> str:
    """What `now` adds to `sent`; a reading that shrank (a parser bug) is logged and sends nothing more."""
    if now.startswith(sent):
        return now[len(sent):]
    logger.warning("the %s reading of a choice changed after it was sent; the rest of it is not streamed", what)
    return ""


def finish_reason(reason: str | None, message: ChatMessage | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for a choice that stopped after making calls."""
    if reason == "stop" and message is not None and message.tool_calls:
        return "tool_calls"
    return reason


class ChoiceParsers:
    """The parsers of one request's choices, each made on its first delta (from the rendered prompt's text)."""

    def __init__(self, make: Callable[[str | None], ChoiceParser]) -> None:
        self._make = make
        self._parsers: dict[int, ChoiceParser] = {}

    def feed(self, index: int, prompt: str | None, text: str, reason: str | None) -> tuple[MessageDelta, str | None]:
        """(what choice `index` gained from `text`, its OpenAI finish_reason once `reason` ends it)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._make(prompt)
        final = reason is not None
        delta = parser.feed(text, final)
        return delta, finish_reason(reason, parser.message()) if final else None
