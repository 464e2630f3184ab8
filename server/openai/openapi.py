"""The OpenAPI 3.1 document of the HTTP API, served at `/openapi.json`, built from the request definitions in
`protocol.py`: every field a body may carry, typed as the parser checks it (unknown fields are refused, so objects are
closed). Ranges the parser enforces at run time (n, logprobs, token ids in the vocabulary, the context) are stated
where they are fixed numbers; the rest the server answers with a 400 and the OpenAI error body, as documented here.
"""

from __future__ import annotations

from typing import Any

from server.openai.protocol import (
    BOOL_FIELDS, CHAT_FIELDS, CHAT_TEMPLATE_FIELDS, COMPLETION_FIELDS, HARMLESS_FIELDS, INT_FIELDS, MAX_LOGPROBS,
    MAX_PROMPTS, MAX_REQUEST_ID_CHARS, MAX_TOKEN_ID_ENTRIES, NUMBER_FIELDS, ROLES,
)
from server.openai.structured import FIELD_SCHEMAS as STRUCTURED_FIELD_SCHEMAS
from jengine.sampling.params import MAX_STOP_STRINGS
from jengine.tools.request import MAX_TOOLS

_INT = {"type": "integer"}
_STR = {"type": "string"}
_IDS = {"type": "array", "items": _INT, "minItems": 1}
_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": _STR, "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": _STR, "arguments": {"type": "string", "description": "a JSON object's text"}}}}}
_MESSAGE = {"type": "object", "additionalProperties": False, "required": ["role"], "properties": {
    "role": {"enum": sorted(ROLES)}, "name": _STR,
    "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "assistant messages only"},
    "tool_call_id": {"type": "string", "description": "tool messages (required there)"},
    "reasoning_content": _STR, "reasoning": _STR}}
_TOOL = {"type": "object", "additionalProperties": False, "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {
        "type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64}, "description": _STR,
            "parameters": {"type": "object", "description": "a JSON schema"}, "strict": {"type": "boolean"}}}}}
_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": _STR}}}}],
    "description": '"auto" (the default with tools) needs the server started with --enable-auto-tool-choice'}
_SPECIAL: dict[str, dict[str, Any]] = {  # fields whose type is more than number, integer or boolean
    "model": _STR, "stream": {"type": "boolean"}, "priority": _INT, "echo": {"type": "boolean"},
    "request_id": {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID_CHARS},
    "stream_options": {"type": "object", "additionalProperties": False, "properties": {
        name: {"type": "boolean"} for name in ("include_usage", "continuous_usage_stats", "include_obfuscation")}},
    "stop": {"oneOf": [_STR, {"type": "array", "items": {"type": "string", "minLength": 1},
                              "maxItems": MAX_STOP_STRINGS}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_TOKEN_ID_ENTRIES},
    "logit_bias": {"type": "object", "maxProperties": MAX_TOKEN_ID_ENTRIES,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "max_tokens": {"type": "integer", "minimum": 0}, "max_completion_tokens": {"type": "integer", "minimum": 1},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _IDS,
                         {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                          "maxItems": MAX_PROMPTS},
                         {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}]},
    "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object"},
    "tools": {"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}, "tool_choice": _TOOL_CHOICE,
    **{name: {} for name in HARMLESS_FIELDS}, "user": _STR, "metadata": {"type": "object"},
    "parallel_tool_calls": {"type": "boolean", "description": "false: at most one call"},
    **STRUCTURED_FIELD_SCHEMAS,
}
_KIND = {**{n: {"type": "number"} for n in NUMBER_FIELDS}, **{n: _INT for n in INT_FIELDS},
         **{n: {"type": "boolean"} for n in BOOL_FIELDS}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": _STR, "type": _STR, "param": {"type": ["string", "null"]}, "code": _STR}}}}


def field_schema(name: str, fields: frozenset[str], required: list[str],
                 overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A closed object schema of `fields`, each typed by `_KIND`, `_SPECIAL` or `overrides`."""
    table = {**_KIND, **_SPECIAL, **(overrides or {})}
    return {"title": name, "type": "object", "additionalProperties": False, "required": required,
            "properties": {field: table[field] for field in sorted(fields)}}


def request_schemas() -> dict[str, dict[str, Any]]:
    tokenize_fields = frozenset({"model", "add_special_tokens", "return_token_strs", "prompt", "messages", "tools"})
    return {
        "CompletionRequest": field_schema("CompletionRequest", COMPLETION_FIELDS, ["prompt"], {
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}}),
        "ChatCompletionRequest": field_schema("ChatCompletionRequest", CHAT_FIELDS, ["messages"],
                                              {"logprobs": {"type": "boolean"},
                                               "include_reasoning": {"type": "boolean"}}),
        "TokenizeRequest": field_schema("TokenizeRequest", tokenize_fields | CHAT_TEMPLATE_FIELDS, [], {
            "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"},
            "prompt": _STR}),
        "DetokenizeRequest": field_schema("DetokenizeRequest", frozenset({"model", "tokens"}), ["tokens"], {
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}),
        "Error": _ERROR,
    }


def _operation(summary: str, body: str | None = None, ok: str = "application/json") -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {ok: {}}},
                                 "default": {"description": "An OpenAI error body",
                                             "content": {"application/json": {
                                                 "schema": {"$ref": "#/components/schemas/Error"}}}}}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}
    return operation


def openapi_document(version: str) -> dict[str, Any]:
    """The whole document: every route of the app, the request schemas, the bearer scheme the API key uses."""
    model_path = {"name": "model", "in": "path", "required": True, "schema": _STR}
    paths = {
        "/v1/completions": {"post": _operation("Text completion (streams SSE when stream is true)",
                                               "CompletionRequest")},
        "/v1/chat/completions": {"post": _operation("Chat completion (streams SSE when stream is true)",
                                                    "ChatCompletionRequest")},
        "/v1/models": {"get": _operation("The served model and its aliases")},
        "/v1/models/{model}": {"get": {**_operation("One model card"), "parameters": [model_path]}},
        "/tokenize": {"post": _operation("Token ids of a prompt or a chat", "TokenizeRequest")},
        "/detokenize": {"post": _operation("Text of token ids", "DetokenizeRequest")},
        "/health": {"get": _operation("200 while serving; 503 while draining or once the engine is dead", ok="*/*")},
        "/ping": {"get": _operation("Alias of /health", ok="*/*"), "post": _operation("Alias of /health", ok="*/*")},
        "/version": {"get": _operation("The server's version")},
        "/metrics": {"get": _operation("Prometheus metrics", ok="text/plain")},
        "/openapi.json": {"get": _operation("This document")},
    }
    return {"openapi": "3.1.0", "info": {"title": "jengine OpenAI-compatible API", "version": version},
            "paths": paths, "components": {"schemas": request_schemas(), "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"}}}}
