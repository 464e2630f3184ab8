"""A chat request's tools and tool choice, checked once for every front end, and how its output is to be read.

OpenAI's shapes: `tools` a list of `{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}`; `tool_choice` "none" | "auto" | "required" | `{"type": "function", "function": {"name"}}` (default
"auto" when there are tools, else "none"). "auto" reads calls out of the model's text with the server's
`--tool-call-parser`, so it needs `--enable-auto-tool-choice`, as in vLLM; "none" never reads calls (the template
still sees the tools).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from jengine.config import ChatParsingConfig
from jengine.errors import InvalidRequestError
from jengine.outputs import ChatMessage
from jengine.sampling.params import SamplingParams, StructuredOutputsParams
from jengine.tools.parsers import FORCED, tool_parser
from jengine.tools.reasoning import reasoning_parser
from jengine.tools.required import forced_tool_choice
from jengine.tools.stream import ChoiceParser

ToolChoice = Literal["none", "auto", "required", "function"]
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Mapping[str, Any], ...]  # as given (checked): what the chat template receives
    choice: ToolChoice
    function: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    def function_tool(self) -> Mapping[str, Any] | None:
        """The named function's definition (`{"name", "parameters", ...}`) for a named tool_choice."""
        return next((t["function"] for t in self.tools if t["function"]["name"] == self.function), None)


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The checked request (None for no tools and no choice); a bad value is a 400 naming the field."""
    checked = _check_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice, function = _check_choice(tool_choice, checked)
    if not checked and choice == "none":
        return None
    return ToolRequest(checked, choice, function, parallel_tool_calls is not False)


def _check_tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be an array of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools takes at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is given twice",
                                      param=f"tools[{i}].function.name")
        names.add(name)
    return tuple(tools)


def _check_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or set(tool) - _TOOL_KEYS:
        raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (function "
                                  f"tools only)", param=where)
    function = tool.get("function")
    if not isinstance(function, Mapping) or set(function) - _FUNCTION_KEYS:
        raise InvalidRequestError(f"{where}.function must be an object with name, description, parameters and "
                                  f"strict only", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise InvalidRequestError(f"{where}.function.name must be a string of 1 to 64 characters",
                                  param=f"{where}.function.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", Mapping, "an object (a JSON "
                                                                                          "schema)"),
                            ("strict", bool, "a boolean")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise InvalidRequestError(f"{where}.function.{key} must be {what}", param=f"{where}.function.{key}")
    return name


def _check_choice(choice: Any, tools: tuple[Mapping[str, Any], ...]) -> tuple[ToolChoice, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidRequestError('tool_choice "required" needs tools', param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(f"tool_choice names the function {name[:64]!r}, which is not among the tools",
                                  param="tool_choice")
    return "function", name


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """How one request's choices are read: the server's reasoning parser, and its tool-call parser when this
    request's calls come from the text (tool_choice "auto"), or the reader of forced calls ("required" or a named
    function, whose grammar makes the reply a JSON array of calls)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    max_calls: int | None = None
    constrained: bool = False  # structured output: the grammar applies after the reasoning (read as starting in it)
    # vLLM's include_reasoning: False leaves the reasoning out of the answer (still read apart from the content)
    include_reasoning: bool = True

    @classmethod
    def plan(cls, config: ChatParsingConfig, tools: ToolRequest | None, constrained: bool = False
             ) -> ChatParsing | None:
        """None when nothing is to be read (no reasoning parser, no auto tool choice). Raises the 400 of an "auto"
        choice on a server without `--enable-auto-tool-choice`. A `constrained` reply (structured output) under a
        reasoning parser reasons first, the grammar applying once the span ends (the front makes it wait)."""
        if tools is not None and tools.choice in ("required", "function"):  # a grammar makes the reply calls
            return cls(config.reasoning_parser, FORCED, constrained=True)
        auto = tools is not None and tools.choice == "auto" and bool(tools.tools)
        if auto and not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise InvalidRequestError('tool_choice "auto" (the default when tools are given) needs the server '
                                      'started with --enable-auto-tool-choice and --tool-call-parser; send '
                                      'tool_choice "none" to use the tools only in the prompt',
                                      param="tool_choice")
        if not auto and config.reasoning_parser is None:
            return None
        max_calls = None if tools is None or tools.parallel else 1
        return cls(config.reasoning_parser, config.tool_call_parser if auto else None, max_calls, constrained)

    @classmethod
    def plan_offline(cls, config: ChatParsingConfig, tools: ToolRequest | None, constrained: bool = False
                     ) -> ChatParsing | None:
        """`LLM.chat`'s plan: the tools reach the template whatever the flags (as in vLLM's `LLM.chat`), and calls
        are read whenever a tool_call_parser is set (no server flag to opt in)."""
        if tools is not None and tools.choice == "auto" and config.tool_call_parser is None:
            tools = dataclasses.replace(tools, choice="none")
        return cls.plan(dataclasses.replace(config, enable_auto_tool_choice=config.tool_call_parser is not None),
                        tools, constrained)

    def read(self, prompt: str | None, text: str) -> ChatMessage:
        """The whole message of one finished choice."""
        parser = self.choice(prompt)
        parser.feed(text, final=True)
        return parser.message()

    def structured(self, constraint: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """A reply's constraint as this plan reads the reply: applied after the reasoning span (the front makes the
        grammar wait for its end) when a reasoning parser reads one."""
        if constraint is None or self.reasoning_parser is None:
            return constraint
        return dataclasses.replace(constraint, after_reasoning=True)

    @property
    def needs_special_tokens(self) -> bool:
        """The tool format's markers are special tokens, which the decoded text must keep."""
        return self.tool_call_parser is not None and tool_parser(self.tool_call_parser).needs_special_tokens

    def choice(self, prompt: str | None) -> ChoiceParser:
        """A parser for one choice of a request whose rendered prompt is `prompt`."""
        reasoning = None if self.reasoning_parser is None else reasoning_parser(self.reasoning_parser, prompt,
                                                                                 self.constrained)
        tools = None if self.tool_call_parser is None else tool_parser(self.tool_call_parser)
        return ChoiceParser(reasoning, tools, self.max_calls)


def with_forced_calls(params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """`params` constrained to the calls a forced tool choice asks for (`jengine.tools.required`'s schema as the
    grammar), or as they are for any other choice. A request already constrained otherwise is a 400."""
    if tools is None or tools.choice not in ("required", "function"):
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError("the output is constrained twice (a response format and a forced tool choice); "
                                  "send one", param="tool_choice")
    choice = "required" if tools.choice == "required" else {"type": "function", "function": {"name": tools.function}}
    forced = forced_tool_choice([dict(t) for t in tools.tools], choice, tools.parallel)
    assert forced is not None
    return params.clone(structured_outputs=StructuredOutputsParams(json=forced.schema))
