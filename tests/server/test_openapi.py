"""The served OpenAPI document, and schemathesis against the live server: requests generated from it (positive: valid
by the schema; negative: each breaking it somewhere) never get a 5xx, and every 4xx carries the OpenAI error body.

Bounded: a fixed number of examples per operation and mode, derandomized (a fixed seed), generation capped at two
tokens, and the whole run held to a wall-clock budget."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.server.conftest import ServerHandle

EXAMPLES = 6  # per operation and mode
BUDGET_S = 45.0  # the whole run, on the 2-core CI machine
MAX_TOKENS = 2
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def test_openapi_document_lists_every_route(server: ServerHandle) -> None:
    response = server.http.get("/openapi.json")
    assert response.status_code == 200
    doc = response.json()
    assert doc["openapi"].startswith("3.1")
    routes = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/v1/models/{model}"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"),
            ("GET", "/metrics"), ("GET", "/version"), ("GET", "/openapi.json"), ("GET", "/ping"), ("POST", "/ping")} == routes
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and "prompt" in completion["required"]
    assert {"temperature", "n", "logprobs", "echo", "stop", "logit_bias"} <= set(completion["properties"])


def _bounded(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with generation capped, so valid examples stay cheap."""
    doc = copy.deepcopy(doc)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = doc["components"]["schemas"][name]["properties"]
        properties["max_tokens"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS}
        properties["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        properties.pop("max_completion_tokens", None)
    return doc


def _cap_generation(case: Any) -> None:
    """Negative examples may still ask for long outputs (a max_tokens over the schema's cap is valid to the
    server): hold every generation request to MAX_TOKENS."""
    if case.path in GENERATION_PATHS and isinstance(case.body, dict):
        tokens = case.body.get("max_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens > MAX_TOKENS:
            case.body["max_tokens"] = MAX_TOKENS
        if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
            case.body["n"] = 2


def _check(case: Any, response: Any) -> None:
    where = f"{case.method} {case.path} {str(case.body)[:300]}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:300]}"
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and isinstance(error["code"], str), where


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_schemathesis_finds_no_5xx_and_only_openai_errors(server: ServerHandle, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_dict(_bounded(server.http.get("/openapi.json").json()))
    started = time.monotonic()
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def exercise(case: Any) -> None:
            nonlocal calls
            assert time.monotonic() - started < BUDGET_S, "schemathesis run over its time budget"
            _cap_generation(case)
            _check(case, case.call(base_url=server.base_url, timeout=20))
            calls += 1

        try:
            exercise()
        except Unsatisfiable:  # negative mode: an operation without parameters or body has nothing to break
            assert mode is GenerationMode.NEGATIVE and "requestBody" not in str(operation.definition.raw)
    assert calls >= 20
    server.wait_idle(5)
