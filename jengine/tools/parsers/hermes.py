"""Hermes format (Qwen2.5, Qwen3, Hermes 2/3): calls as JSON objects in `<tool_call>` ... `</tool_call>` blocks.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before, between and after the blocks is content (whitespace right after a block is dropped). A block whose
object has no name is not a call: its text stays in the content as written.
"""

from __future__ import annotations

from jengine.tools.json_scan import skip_whitespace
from jengine.tools.parsers.base import ToolParser, ToolScan, call_of_object, plain_until

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> ToolScan:
        out, pos = ToolScan(), 0
        while True:
            plain, start = plain_until(text, START, pos, final)
            out.content += plain
            if start < 0:
                return out
            next_pos = self._block(text, start, final, out)
            if next_pos is None:
                return out
            pos = next_pos

    def _block(self, text: str, start: int, final: bool, out: ToolScan) -> int | None:
        """Read the block at `start` into `out`; the position after it, or None while it is still open."""
        brace = skip_whitespace(text, start + len(START))
        if brace == len(text):
            if final:
                out.content += text[start:]
            return None
        if text[brace] != "{":
            out.content += START  # not a call: the marker is text
            return start + len(START)
        scanner = self.scan_object(text, brace)
        call = call_of_object(scanner, text)
        if call is None:  # no name yet; once the object has ended without one, the block is text
            if scanner.closed or scanner.broken:
                out.content += text[start:scanner.pos]
                return scanner.pos
            if final:
                out.content += text[start:]
            return None
        out.calls.append(call)
        if not (scanner.closed or scanner.broken):
            return None
        return self._after_block(text, scanner.pos, final)

    @staticmethod
    def _after_block(text: str, pos: int, final: bool) -> int | None:
        """Past the end marker (missing markers are forgiven) and the whitespace after it."""
        pos = skip_whitespace(text, pos)
        if text.startswith(END, pos):
            return skip_whitespace(text, pos + len(END))
        if not final and END.startswith(text[pos:]):
            return None  # the end marker may still be arriving
        return pos
