"""Tool-call parsers by the name `--tool-call-parser` takes (vLLM's names), one module per model family's format."""

from __future__ import annotations

from jengine.errors import ConfigError
from jengine.tools.parsers.base import PartialCall, ToolParser, ToolScan
from jengine.tools.parsers.forced import ForcedCallsParser
from jengine.tools.parsers.hermes import HermesParser
from jengine.tools.parsers.llama3_json import Llama3JsonParser
from jengine.tools.parsers.mistral import MistralParser
from jengine.tools.parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


FORCED = ForcedCallsParser.name  # the reply of tool_choice "required" or a named function


def tool_parser(name: str) -> ToolParser:
    """A fresh parser (one per choice: parsers cache their scans of one text); `FORCED` reads forced calls."""
    if name == FORCED:
        return ForcedCallsParser()
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["FORCED", "TOOL_PARSERS", "PartialCall", "ToolParser", "ToolScan", "tool_parser"]
