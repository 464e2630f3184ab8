"""Mistral formats, both after the `[TOOL_CALLS]` special token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (tokenizers up to v3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}          (v11 and later)

Text before the first marker is content, as is text after the calls. Call ids are nine letters and digits, the form
Mistral's chat templates check.
"""

from __future__ import annotations

import secrets
import string

from jengine.tools.json_scan import skip_whitespace
from jengine.tools.parsers.base import PartialCall, ToolParser, ToolScan, call_of_object, plain_until

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def scan(self, text: str, final: bool) -> ToolScan:
        out = ToolScan()
        out.content, pos = plain_until(text, MARKER, 0, final)
        while pos >= 0:
            start = skip_whitespace(text, pos + len(MARKER))
            if start == len(text):
                return out
            read = self._array if text[start] == "[" else self._named
            end = read(text, start, final, out)
            if end is None:
                if final and read is self._named and not out.calls:
                    out.content += text[pos:]  # a marker with no call after it
                return out
            pos = self._after_calls(text, skip_whitespace(text, end), final, out)
        return out

    @staticmethod
    def _after_calls(text: str, pos: int, final: bool, out: ToolScan) -> int:
        """The next marker's index, or -1 with what follows the calls added to the content."""
        if text.startswith(MARKER, pos):
            return pos
        if final or not MARKER.startswith(text[pos:]):
            out.content += text[pos:]
        return -1

    def _array(self, text: str, pos: int, final: bool, out: ToolScan) -> int | None:
        """`[{call}, {call}]`: the position after the `]`, or None while the array is open."""
        pos += 1
        while True:
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                return None
            if text[pos] == "]":
                return pos + 1
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "{":
                return pos  # not a call list after all: the rest is content
            scanner = self.scan_object(text, pos)
            call = call_of_object(scanner, text)
            if call is None:
                return scanner.pos if scanner.closed or scanner.broken else None
            out.calls.append(call)
            if not scanner.closed:
                return scanner.pos if scanner.broken else None
            pos = scanner.pos

    def _named(self, text: str, pos: int, final: bool, out: ToolScan) -> int | None:
        """`name[ARGS]{...}` (a `[CALL_ID]id` after the name is read past): the position after the arguments."""
        args_at = text.find(ARGS, pos)
        if args_at < 0:
            return None
        name = text[pos:args_at].split(CALL_ID, 1)[0].strip()
        brace = skip_whitespace(text, args_at + len(ARGS))
        if brace == len(text) or text[brace] != "{":
            out.calls.append(PartialCall(name, "" if brace == len(text) and not final else "{}"))
            return None if brace == len(text) else brace
        scanner = self.scan_object(text, brace)
        end = scanner.end if scanner.closed else scanner.pos if scanner.broken else len(text)
        out.calls.append(PartialCall(name, text[brace:end]))
        if scanner.closed:
            return scanner.end
        return scanner.pos if scanner.broken else None
