"""An incremental scanner of one JSON object in a growing text: where its top-level members' values start and end.

Tool-call parsers stream a call's arguments as the raw text the model writes, so they must know, before the object is
complete, where the value of `"arguments"` begins and whether it has ended. The scanner follows strings (escapes
included) and nesting only; it never builds values, and it resumes where it stopped when the text grows, so a stream
is scanned once in all, however finely it is split.
"""

from __future__ import annotations

import dataclasses
import json

_WHITESPACE = " \t\r\n"


@dataclasses.dataclass
class Member:
    """One top-level member: its key, and the span of its value's text (`end` None while the value is open)."""

    key: str
    start: int | None = None
    end: int | None = None

    def text(self, source: str) -> str | None:
        """The whole value's text once it has ended."""
        return None if self.start is None or self.end is None else source[self.start:self.end]


class ObjectScanner:
    """Scans the object that opens at `start` (the `{`); call `advance` with the text each time it grows."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.end: int | None = None  # index after the closing brace, once seen
        self.broken = False  # the text is not a JSON object (the scan stops)
        self.members: list[Member] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._expect = "open"  # open | key | colon | value | scalar | nested | string | after

    @property
    def closed(self) -> bool:
        return self.end is not None

    def member(self, *keys: str) -> Member | None:
        """The first member whose key is one of `keys`."""
        return next((m for m in self.members if m.key in keys), None)

    def advance(self, text: str) -> None:
        while self.pos < len(text) and self.end is None and not self.broken:
            self._step(text, text[self.pos])
            if not self.broken:  # a broken scan stops at the offending character
                self.pos += 1

    def _step(self, text: str, char: str) -> None:
        if self._in_string:
            self._string_char(text, char)
        elif char == '"':
            self._open_string()
        elif char in "{[":
            self._open(char)
        elif char in "}]":
            self._close(text)
        elif self._depth == 1:
            self._top_level(text, char)

    def _string_char(self, text: str, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            if self._depth == 1 and self._expect == "key":
                self.members.append(Member(json.loads(text[self._string_start:self.pos + 1])))
                self._expect = "colon"
            elif self._depth == 1 and self._expect == "string":
                self.members[-1].end = self.pos + 1
                self._expect = "after"

    def _open_string(self) -> None:
        self._in_string = True
        if self._depth != 1:
            return
        if self._expect == "key":
            self._string_start = self.pos
        elif self._expect == "value":
            self.members[-1].start = self.pos
            self._expect = "string"
        else:
            self.broken = True

    def _open(self, char: str) -> None:
        if self._expect == "open":
            self.broken = char != "{"
            self._depth, self._expect = 1, "key"
            return
        self._depth += 1
        if self._depth == 2:
            if self._expect != "value":
                self.broken = True
                return
            self.members[-1].start = self.pos
            self._expect = "nested"

    def _close(self, text: str) -> None:
        self._depth -= 1
        if self._depth == 1 and self._expect == "nested":
            self.members[-1].end = self.pos + 1
            self._expect = "after"
        elif self._depth == 0:
            self._end_scalar(text)
            self.end = self.pos + 1

    def _top_level(self, text: str, char: str) -> None:
        if char in _WHITESPACE:
            return
        if char == ":" and self._expect == "colon":
            self._expect = "value"
        elif char == ",":
            self._end_scalar(text)
            self.broken = self._expect != "after"
            self._expect = "key"
        elif self._expect == "value":
            self.members[-1].start = self.pos
            self._expect = "scalar"
        elif self._expect != "scalar":
            self.broken = True

    def _end_scalar(self, text: str) -> None:
        if self._expect == "scalar":
            member = self.members[-1]
            assert member.start is not None
            member.end = member.start + len(text[member.start:self.pos].rstrip(_WHITESPACE))
            self._expect = "after"


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker`: text a stream must hold back,
    since it may turn out to be the marker once more arrives."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
