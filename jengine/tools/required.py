"""`tool_choice="required"` and a named function, enforced by a grammar: the model's whole output is a JSON array of
{"name": one of the offered functions, "parameters": arguments valid against that function's schema}.

Pure data, no server or engine imports: `forced_tool_choice` reads the request's tools into a `ForcedToolChoice`
(its JSON schema constrains the output as `StructuredOutputsParams(json=...)`); the reply is read into tool calls by
`jengine.tools.parsers.forced`, as parsed calls are, so it streams the same way. `parallel_tool_calls: false` or a
named function means exactly one call; otherwise between 1 and MAX_TOOL_CALLS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jengine.errors import InvalidRequestError

MAX_TOOL_CALLS = 8  # calls in one parallel response: the grammar's bound on the array
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ForcedToolChoice:
    """The functions the output must call, and the JSON schema of that output."""

    names: tuple[str, ...]
    single: bool  # exactly one call
    schema: dict[str, Any]


def forced_tool_choice(tools: Any, tool_choice: Any, parallel_tool_calls: Any = True) -> ForcedToolChoice | None:
    """The grammar's view of `tool_choice` "required" or {"type": "function", "function": {"name": ...}}; None for
    "none", "auto" or no choice (the caller handles those). Bad tools or an unknown name are a 400."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        chosen, single = functions, parallel_tool_calls is False
    else:
        name = _named_choice(tool_choice)
        chosen = {k: v for k, v in functions.items() if k == name}
        if not chosen:
            raise InvalidRequestError(f"tool_choice names the function {name[:64]!r}, which is not in tools",
                                      param="tool_choice")
        single = True
    return ForcedToolChoice(tuple(chosen), single, tool_call_schema(chosen, single))


def tool_call_schema(functions: Mapping[str, dict[str, Any]], single: bool) -> dict[str, Any]:
    """An array of calls, each {"name": <function>, "parameters": <its schema>} for one of `functions`."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": item, "minItems": 1, "maxItems": 1 if single else MAX_TOOL_CALLS}


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name → parameters schema of each {"type": "function", "function": {...}} in `tools`."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tool_choice needs a non-empty tools array", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                      param=f"tools[{i}]")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      param=f"tools[{i}].function.parameters")
        functions[name] = parameters or _EMPTY_PARAMETERS
    return functions


def _named_choice(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    return name
