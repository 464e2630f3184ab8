"""Structured output through the official `openai` client: with random weights, the grammar alone makes every
output valid (json_schema checked with `jsonschema`, regex and choice by fullmatch), streamed and not; tool_choice
"required" and a named function give calls whose arguments validate; bad constraints are a 400."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from jengine.tools.required import MAX_TOOL_CALLS
from tests.server.conftest import MODEL_NAME, ServerHandle, metric, scrape

USER = [{"role": "user", "content": "hi"}]
CHAT = dict(model=MODEL_NAME, messages=USER)
STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 3, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "admin": {"type": "boolean"}},
                  "required": ["id", "admin"], "additionalProperties": False},
    },
    "required": ["name", "size", "count", "tags", "owner"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
DIGIT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
         "additionalProperties": False}
SHORT_TOOL = [{"type": "function", "function": {"name": "f", "parameters": DIGIT}}]  # room for MAX_TOOL_CALLS calls
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME, "f": DIGIT}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate(server: ServerHandle, seed: int) -> None:
    response = server.client().chat.completions.create(**CHAT, response_format=JSON_SCHEMA_FORMAT,
                                                       max_tokens=120, temperature=1.0, seed=seed)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert not re.search(r"\s", STRING_LITERAL.sub("", choice.message.content))  # compact: no blank between tokens


def test_json_schema_streamed_and_on_completions(server: ServerHandle) -> None:
    stream = server.client().chat.completions.create(**CHAT, response_format=JSON_SCHEMA_FORMAT,
                                                     max_tokens=120, temperature=1.0, seed=7, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    completion = server.client().completions.create(model=MODEL_NAME, prompt="data:", max_tokens=120, temperature=1.0,
                                                    seed=3, n=2, extra_body={"guided_json": SCHEMA})
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_json_object_regex_and_choice(server: ServerHandle) -> None:
    client = server.client()
    obj = client.chat.completions.create(**CHAT, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0.7, seed=1)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for seed in range(3):
        regex = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text)
        choice = client.chat.completions.create(**CHAT, max_tokens=10, temperature=1.0, seed=seed,
                                                extra_body={"guided_choice": ["yes", "no", "maybe not"]})
        assert choice.choices[0].message.content in ("yes", "no", "maybe not")
    lark = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=20, temperature=1.0, seed=5,
                                     extra_body={"structured_outputs": {"grammar": 'start: "a" /[0-9]+/ "z"'}})
    assert re.fullmatch(r"a[0-9]+z", lark.choices[0].text)


def test_disable_additional_properties_closes_objects(server: ServerHandle) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    for seed in range(3):
        out = server.client().completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": open_schema, "disable_additional_properties": True}})
        assert set(json.loads(out.choices[0].text)) <= {"a"}


def test_structural_tag_spans_validate(server: ServerHandle) -> None:
    """Free text where every complete <f>...</f> span holds JSON valid against the tag's schema."""
    tag = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": WEATHER, "end": "</f>"}]}
    ids = [server.http.post("/tokenize", json={"prompt": c, "add_special_tokens": False}).json()["tokens"]
           for c in "<f>"]
    bias = {str(t): 30 for [t] in ids}  # free text then writes the trigger soon: the tag's grammar takes over
    spans = 0
    for seed in range(3):
        text = server.client().completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=60, temperature=1.0, seed=seed, logit_bias=bias,
            extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}}).choices[0].text
        for span in re.findall(r"<f>(.*?)</f>", text, flags=re.S):
            jsonschema.validate(json.loads(span), WEATHER)
            spans += 1
    assert spans


def test_cut_by_max_tokens_is_length(server: ServerHandle) -> None:
    response = server.client().chat.completions.create(**CHAT, response_format=JSON_SCHEMA_FORMAT,
                                                       max_tokens=4, temperature=1.0, seed=0)
    assert response.choices[0].finish_reason == "length"


def test_constrained_and_free_rows_share_a_batch(server: ServerHandle) -> None:
    """Constrained requests and a free greedy one at once: the constrained outputs validate and the free one is the
    text it has alone (its row is not constrained)."""
    client = server.client()

    def free() -> str:
        return client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def constrained(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=120, temperature=1.0,
                                         seed=seed, extra_body={"guided_json": SCHEMA}).choices[0].text

    free_alone = free()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = [pool.submit(constrained, seed) for seed in range(3)]
        free_beside = pool.submit(free)
        for out in outs:
            jsonschema.validate(json.loads(out.result()), SCHEMA)
        assert free_beside.result() == free_alone


def _reassembled_calls(chunks: list) -> list:
    """Streamed tool-call deltas put together by index: the first has the id and name, later ones more arguments."""
    calls: dict[int, Any] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = delta.model_copy(deep=True)
            else:
                calls[delta.index].function.arguments += delta.function.arguments or ""
    return list(calls.values())


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_validate(server: ServerHandle, stream: bool) -> None:
    for seed in range(2):
        parallel = seed == 0
        kwargs = dict(**CHAT, tools=SHORT_TOOL if parallel else TOOLS, tool_choice="required",
                      max_tokens=200 if parallel else 120, temperature=1.0, seed=seed, parallel_tool_calls=parallel)
        if stream:
            chunks = [c for c in server.client().chat.completions.create(stream=True, **kwargs) if c.choices]
            finish = chunks[-1].choices[0].finish_reason
            calls = _reassembled_calls(chunks)
            assert all(not c.choices[0].delta.content for c in chunks)
        else:
            choice = server.client().chat.completions.create(**kwargs).choices[0]
            finish, calls = choice.finish_reason, choice.message.tool_calls
            assert choice.message.content is None
        assert finish == "tool_calls" and calls
        assert 1 <= len(calls) <= (MAX_TOOL_CALLS if parallel else 1)  # parallel_tool_calls false: exactly one
        for call in calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_named_function_is_the_one_called(server: ServerHandle) -> None:
    choice = server.client().chat.completions.create(
        **CHAT, tools=TOOLS, max_tokens=120, temperature=1.0, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "strin"}}}},
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "response_format"),
    ({"extra_body": {"guided_regex": "[a-"}}, "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nothing_defined"}}}, "grammar"),
    ({"extra_body": {"guided_choice": []}}, "choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
    ({"extra_body": {"tool_choice": "required"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_constraints_are_400(server: ServerHandle, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(**CHAT, max_tokens=8, **body)
    assert caught.value.body["param"] == param and caught.value.body["message"]


def test_structured_requests_are_counted_by_kind(server: ServerHandle) -> None:
    before = metric(scrape(server), "jengine:structured_output_requests_total", kind="regex")
    server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, extra_body={"guided_regex": "ab"})
    assert metric(scrape(server), "jengine:structured_output_requests_total", kind="regex") == before + 1
    server.wait_idle()
