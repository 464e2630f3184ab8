"""`StructuredOutputsParams`: what a request's output must match (vLLM's names), checked on the host.

Host only and dependency-free: SamplingParams carries it and the servers build it. Exactly one of the constraint
fields is set; `kind` names it (the metrics label and the grammar builder's switch).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jengine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's `StructuredOutputsParams`)."""

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None  # the whole output fullmatches this regular expression
    choice: tuple[str, ...] | list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect; `start` is the top rule)
    json_object: bool | None = None  # any JSON object (OpenAI's JSON mode)
    structural_tag: str | dict[str, Any] | None = None  # vLLM's structural tag: tagged JSON spans in free text
    # JSON grammars allow no whitespace between tokens unless this is False: a model with uncertain weights cannot
    # then wander in blanks (vLLM's `disable_any_whitespace`, on by default here).
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False  # objects of the schema accept no properties it does not name
    # The constraint applies once the reply's reasoning span has ended (after `</think>`; from the first token when
    # the prompt already closed the span): the chat front ends set it under a reasoning parser.
    after_reasoning: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, _parse_json(name, value))

    @property
    def kind(self) -> str:
        """The one constraint set (see `validate`; "none" when none is)."""
        return next((name for name in KINDS if _is_set(getattr(self, name))), "none")

    def validate(self) -> None:
        """Raise InvalidRequestError(param=<field>) unless exactly one constraint is set, with the right type."""
        given = [name for name in KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            raise InvalidRequestError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                                      f"{', '.join(given) or 'none'}", param="structured_outputs")
        kind = given[0]
        for flag in ("json_object", "disable_any_whitespace", "disable_additional_properties", "after_reasoning"):
            if not isinstance(getattr(self, flag), (bool, type(None))):
                raise InvalidRequestError(f"{flag} must be a boolean", param=flag)
        if kind in ("json", "structural_tag") and not isinstance(getattr(self, kind), dict):
            raise InvalidRequestError(f"{kind} must be a JSON object", param=kind)
        if kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise InvalidRequestError(f"{kind} must be a string", param=kind)
        if kind == "choice" and not (isinstance(self.choice, tuple) and self.choice
                                     and all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of strings", param="choice")


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _parse_json(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{name} is not valid JSON: {exc}", param=name) from None
