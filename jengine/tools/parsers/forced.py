"""The reply of a forced tool choice (`tool_choice` "required" or a named function): the grammar makes the whole
reply a JSON array of calls, `[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]`, so it is all calls
and no content. Read like any other format, so forced calls stream as deltas too."""

from __future__ import annotations

from jengine.tools.json_scan import skip_whitespace
from jengine.tools.parsers.base import ToolParser, ToolScan, call_of_object


class ForcedCallsParser(ToolParser):
    name = "forced"  # not a --tool-call-parser: the request's tool_choice selects it

    def scan(self, text: str, final: bool) -> ToolScan:
        out, pos = ToolScan(), skip_whitespace(text, 0)
        if pos == len(text) or text[pos] != "[":
            return ToolScan(text if final or pos < len(text) else "")
        pos += 1
        while True:
            pos = skip_whitespace(text, pos)
            if pos == len(text) or text[pos] == "]":
                return out
            if text[pos] == ",":
                pos += 1
                continue
            scanner = self.scan_object(text, pos) if text[pos] == "{" else None
            call = None if scanner is None else call_of_object(scanner, text)
            if scanner is None or call is None:
                return out  # a grammar-made reply is all calls: anything else is where it was cut
            out.calls.append(call)
            if not scanner.closed:
                return out
            pos = scanner.pos
