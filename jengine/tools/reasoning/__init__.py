"""Reasoning parsers by the name `--reasoning-parser` takes (vLLM's names)."""

from __future__ import annotations

from jengine.errors import ConfigError
from jengine.tools.reasoning.think import CLOSE as REASONING_END
from jengine.tools.reasoning.think import (DeepSeekR1Parser, Qwen3Parser, ReasoningParser, ReasoningScan,
                                           prompt_closed_reasoning)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3Parser, DeepSeekR1Parser)
}


def reasoning_parser(name: str, prompt: str | None = None, constrained: bool = False) -> ReasoningParser:
    """A parser for one choice; `prompt` (the rendered prompt text) tells whether the template opened the thinking;
    `constrained`: a structured-output reply, whose grammar waits for the reasoning's end."""
    if name not in REASONING_PARSERS:
        raise ConfigError(f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](prompt, constrained)


__all__ = ["REASONING_END", "REASONING_PARSERS", "ReasoningParser", "ReasoningScan", "prompt_closed_reasoning",
           "reasoning_parser"]
