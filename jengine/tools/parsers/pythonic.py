"""Pythonic format (Llama 3.2 and 4, ToolACE): a Python list of calls with keyword arguments, optionally between
`<|python_start|>` and `<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(timezone="UTC")]

Arguments become a JSON object, one member per keyword as it completes (`True` → true, `None` → null); a value that
is not a Python literal is kept as its source text in a JSON string. The literals are read by `ast.literal_eval`,
which parses and never runs anything. A reply that does not open with such a list is content.
"""

from __future__ import annotations

import ast
import json
import re

from jengine.tools.json_scan import skip_whitespace
from jengine.tools.parsers.base import PartialCall, ToolParser, ToolScan

START, END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(")
_MAYBE_HEAD = re.compile(r"\s*(?:[A-Za-z_][A-Za-z0-9_.]*\s*)?")  # what may still grow into a call head
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)", re.DOTALL)
_CLOSERS = {")": "(", "]": "[", "}": "{"}


class PythonicParser(ToolParser):
    name = "pythonic"
    needs_special_tokens = True  # <|python_start|> is a special token

    def __init__(self) -> None:
        super().__init__()
        self._argument_ends: dict[int, int] = {}  # start of an argument → its terminating `,` or `)`
        self._members: dict[int, str | None] = {}  # start of a complete argument → its JSON member
        self._closed_calls: dict[int, tuple[str, int]] = {}  # start of a call's arguments → (JSON, end)

    def scan(self, text: str, final: bool) -> ToolScan:
        pos = skip_whitespace(text, 0)
        tagged = text.startswith(START, pos)
        if tagged:
            pos = skip_whitespace(text, pos + len(START))
        elif not final and START.startswith(text[pos:]):
            return ToolScan()
        if pos == len(text):
            return ToolScan(text if final else "")
        if text[pos] != "[" or not _CALL_HEAD.match(text, pos + 1):
            still_open = not final and text[pos] == "[" and _MAYBE_HEAD.fullmatch(text, pos + 1)
            return ToolScan() if still_open else ToolScan(text)
        return self._calls(text, pos + 1, final, tagged)

    def _calls(self, text: str, pos: int, final: bool, tagged: bool) -> ToolScan:
        out = ToolScan()
        while True:
            head = _CALL_HEAD.match(text, pos)
            if head is None:
                if final or not _MAYBE_HEAD.fullmatch(text, pos):
                    out.content = text[pos:]
                return out
            arguments, end = self._arguments(text, head.end())
            out.calls.append(PartialCall(head.group(1), arguments))
            pos = skip_whitespace(text, end) if end is not None else len(text)
            if end is None or pos == len(text):
                return out
            if text[pos] != ",":
                out.content = _after_list(text, pos, final, tagged)
                return out
            pos += 1

    def _arguments(self, text: str, pos: int) -> tuple[str, int | None]:
        """(the JSON object of the keyword arguments complete so far, the position after `)` or None if open)."""
        if pos in self._closed_calls:
            return self._closed_calls[pos]
        arguments, end = self._read_arguments(text, pos)
        if end is not None:
            self._closed_calls[pos] = arguments, end
        return arguments, end

    def _read_arguments(self, text: str, pos: int) -> tuple[str, int | None]:
        members: list[str] = []
        while True:
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                return "{" + ", ".join(members), None
            if text[pos] == ")":
                return "{" + ", ".join(members) + "}", pos + 1
            end = self._argument_end(text, pos)
            if end is None:
                return "{" + ", ".join(members), None
            if pos not in self._members:
                self._members[pos] = _member(text[pos:end])
            member = self._members[pos]
            if member is not None:
                members.append(member)
            pos = end + 1 if text[end] == "," else end

    def _argument_end(self, text: str, pos: int) -> int | None:
        """The index of the `,` or `)` that ends the argument at `pos` (brackets and strings skipped)."""
        if pos in self._argument_ends:
            return self._argument_ends[pos]
        stack: list[str] = []
        quote, index = "", pos
        while index < len(text):
            char = text[index]
            if quote:
                if char == "\\":
                    index += 1
                elif char == quote:
                    quote = ""
            elif char in "'\"":
                quote = char
            elif char in "([{":
                stack.append(char)
            elif char in _CLOSERS and stack and stack[-1] == _CLOSERS[char]:
                stack.pop()
            elif char in ",)" and not stack:
                self._argument_ends[pos] = index
                return index
            index += 1
        return None


def _member(source: str) -> str | None:
    """`key=value` as the JSON member `"key": value`; None for anything else (a positional argument)."""
    keyword = _KEYWORD.fullmatch(source)
    if keyword is None:
        return None
    value_source = keyword.group(2).strip()
    try:
        value = ast.literal_eval(value_source)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = value_source
    try:
        value_json = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # e.g. a dict with tuple keys
        value_json = json.dumps(value_source, ensure_ascii=False)
    return f"{json.dumps(keyword.group(1))}: {value_json}"


def _after_list(text: str, pos: int, final: bool, tagged: bool) -> str:
    """The content after the calls: what follows the `]` (and the end tag)."""
    if text[pos] == "]":
        pos = skip_whitespace(text, pos + 1)
        if tagged and text.startswith(END, pos):
            pos = skip_whitespace(text, pos + len(END))
        elif tagged and not final and END.startswith(text[pos:]):
            return ""
    return text[pos:]
