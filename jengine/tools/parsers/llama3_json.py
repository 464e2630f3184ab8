"""Llama 3.1 / 3.2 JSON format: the reply is one or more call objects, `;`-separated, after an optional
`<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A reply that starts with anything else is content, as is one whose first object has no name; text after the calls
is content too.
"""

from __future__ import annotations

from jengine.tools.json_scan import skip_whitespace
from jengine.tools.parsers.base import ToolParser, ToolScan, call_of_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def scan(self, text: str, final: bool) -> ToolScan:
        pos = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_whitespace(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return ToolScan()  # nothing but whitespace, or the tag still arriving
        if pos == len(text) or text[pos] != "{":
            return ToolScan(text if final or pos < len(text) else "")
        return self._calls(text, pos, final)

    def _calls(self, text: str, pos: int, final: bool) -> ToolScan:
        out = ToolScan()
        while True:
            scanner = self.scan_object(text, pos)
            call = call_of_object(scanner, text)
            if call is None:
                if not out.calls and (scanner.closed or scanner.broken or final):
                    return ToolScan(text)  # a JSON reply, not a call
                if scanner.closed or scanner.broken or final:
                    out.content = text[pos:]  # a later object that is no call: the rest is content
                return out
            out.calls.append(call)
            if not scanner.closed:
                if scanner.broken:
                    out.content = text[scanner.pos:]
                return out
            pos = _next_object(text, scanner.pos)
            if pos == len(text):
                return out
            if text[pos] != "{":
                out.content = text[pos:]
                return out


def _next_object(text: str, pos: int) -> int:
    """Past the whitespace and `;` separators between calls."""
    while pos < len(text) and (text[pos] == ";" or text[pos].isspace()):
        pos = pos + 1
    return pos
