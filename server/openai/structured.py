"""The request fields that constrain the output → one `StructuredOutputsParams` (or None).

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` extra and its older `guided_*`
names; at most one of them per request, and `tool_choice` "required" or a named function (whose schema is the
constraint) excludes them all. Shapes are checked here (a 400 naming the field); the grammar itself is compiled,
and its errors reported, by the engine's front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jengine.errors import InvalidRequestError
from jengine.sampling.params import StructuredOutputsParams
from jengine.tools.required import ForcedToolChoice

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
_STR, _JSON = {"type": "string"}, {"type": ["object", "string"]}
_CHOICES = {"type": "array", "items": {"type": "string"}, "minItems": 1}
# The fields' OpenAPI schemas (server/openai/openapi.py)
FIELD_SCHEMAS = {
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": _STR, "description": _STR, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    "structured_outputs": {"type": "object", "additionalProperties": False, "properties": {
        "json": _JSON, "regex": _STR, "choice": _CHOICES, "grammar": _STR, "json_object": {"type": "boolean"},
        "structural_tag": _JSON, "disable_any_whitespace": {"type": "boolean"},
        "disable_additional_properties": {"type": "boolean"}}},
    "guided_json": _JSON, "guided_regex": _STR, "guided_choice": _CHOICES, "guided_grammar": _STR,
}
_STRUCTURED_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object", "structural_tag",
                              "disable_any_whitespace", "disable_additional_properties"})


def structured_from_body(body: Mapping[str, Any], forced: ForcedToolChoice | None = None
                         ) -> StructuredOutputsParams | None:
    """The one constraint the body asks for; two sources at once are a 400."""
    found = [(name, params) for name, params in _sources(body) if params is not None]
    if forced is not None:
        found.append(("tool_choice", StructuredOutputsParams(json=forced.schema)))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0][0]} and {found[1][0]} both constrain the output; send one",
                                  param=found[1][0])
    if not found:
        return None
    found[0][1].validate()
    return found[0][1]


def _sources(body: Mapping[str, Any]):
    yield "response_format", _response_format(body.get("response_format"))
    yield "structured_outputs", _structured_outputs(body.get("structured_outputs"))
    for name, key in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            yield name, _guided(name, key, body[name])


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format")
        return StructuredOutputsParams(json=schema)
    raise InvalidRequestError('response_format.type must be "text", "json_object" or "json_schema"',
                              param="response_format")


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - _STRUCTURED_KEYS)
    if unknown:
        raise InvalidRequestError(f"unrecognized structured_outputs field(s): {', '.join(unknown)}"[:300],
                                  param="structured_outputs")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


def _guided(name: str, key: str, value: Any) -> StructuredOutputsParams:
    if key == "choice" and not isinstance(value, list):
        raise InvalidRequestError(f"{name} must be an array of strings", param=name)
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string", param=name)
    return StructuredOutputsParams(**{key: value})
