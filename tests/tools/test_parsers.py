"""Tool-call and reasoning parsers on replies in each model family's real format, fed whole and split at every
boundary: the streamed deltas reassemble exactly to the non-streamed message."""

from __future__ import annotations

import json
import random

import pytest

from jengine.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from jengine.outputs import ChatMessage, ToolCall
from jengine.tools.parsers import TOOL_PARSERS, tool_parser
from jengine.tools.reasoning import REASONING_PARSERS as REASONING_REGISTRY, reasoning_parser
from jengine.tools.stream import ChoiceParser, MessageDelta

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" }{ brace", "opts": {"k": [1, 2, {"x": null}]}, "n": -1.5e3}'

# (parser, reply, content, [(name, arguments)])
TOOL_CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "arguments": {NESTED}}}\n</tool_call>',
     "Let me check.\n", [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", 'Use <b>bold</b> and <tool_ca ll> text; no call here.', 'Use <b>bold</b> and <tool_ca ll> text; '
               'no call here.', []),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>', None, [("ping", "{}")]),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", "{}")]),
    ("hermes", '<tool_call>{"foo": 1}</tool_call>', '<tool_call>{"foo": 1}</tool_call>', []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
                    f'{{"name": "search", "parameters": {NESTED}}}', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("llama3_json", 'The weather in Paris is {"temp": 20}.', 'The weather in Paris is {"temp": 20}.', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
                f'{{"name": "search", "arguments": {NESTED}}}]', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", f'Sure. [TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]search[ARGS]{NESTED}', "Sure. ",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", 'No tools [TOOL needed].', 'No tools [TOOL needed].', []),
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\'), search(q="a, (b)", opts={"k": [1, 2]}, '
                 'exact=True, limit=None)]', None,
     [("get_weather", WEATHER), ("search", '{"q": "a, (b)", "opts": {"k": [1, 2]}, "exact": true, '
                                           '"limit": null}')]),
    ("pythonic", '<|python_start|>[ping()]<|python_end|>', None, [("ping", "{}")]),
    ("pythonic", '[1, 2] are numbers.', '[1, 2] are numbers.', []),
    ("forced", f'[{{"name":"get_weather","parameters":{{"city":"Paris"}}}},{{"name":"search","parameters":{NESTED}}}]',
     None, [("get_weather", '{"city":"Paris"}'), ("search", NESTED)]),
]

# (parser, prompt, reply, reasoning, content)
REASONING_CASES = [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nFirst, 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.",
     "First, 2+2.\nIt is 4.", "The answer is 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "The answer is 4 <thinking> aside.", None,
     "The answer is 4 <thinking> aside."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm, 4.\n</think>\n\n4", "Hmm, 4.", "4"),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nStill thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Okay, 2+2=4.</think>The answer is 4.", "Okay, 2+2=4.",
     "The answer is 4."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Okay.</think>\n\n4", "Okay.", "4"),
    ("deepseek_r1", "<｜Assistant｜>", "no end tag </think", "no end tag </think", None),
]


def _parser(tool: str | None, reasoning: str | None, prompt: str | None = None) -> ChoiceParser:
    return ChoiceParser(None if reasoning is None else reasoning_parser(reasoning, prompt),
                        None if tool is None else tool_parser(tool))


def _reassemble(deltas: list[MessageDelta]) -> ChatMessage:
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.index == len(calls), "a call starts once, in order"
                calls[call.index] = [call.id, call.name, ""]
            calls[call.index][2] += call.arguments
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    return ChatMessage(content or None, reasoning or None,
                       tuple(ToolCall(i, n, a) for i, n, a in calls.values()))


def _splits(text: str) -> list[list[str]]:
    """Every two-way split, every character alone, and random many-way splits."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


def _check_streams(make: callable, text: str) -> ChatMessage:
    whole = make()
    whole.feed(text, final=True)
    expected = whole.message()
    for pieces in _splits(text):
        parser = make()
        deltas = [parser.feed(piece) for piece in pieces] + [parser.feed("", final=True)]
        streamed = _reassemble(deltas)
        assert _without_ids(streamed) == _without_ids(expected), pieces
        assert streamed == parser.message()  # the stream's ids are the message's
    return expected


def _without_ids(message: ChatMessage) -> ChatMessage:
    return ChatMessage(message.content, message.reasoning, tuple(ToolCall("", c.name, c.arguments)
                                                                 for c in message.tool_calls))


@pytest.mark.parametrize("parser,reply,content,calls", TOOL_CASES)
def test_tool_calls_stream_to_the_non_streamed_message(parser: str, reply: str, content: str | None,
                                                       calls: list[tuple[str, str]]) -> None:
    message = _check_streams(lambda: _parser(parser, None), reply)
    assert message.content == content
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls
    extracted = tool_parser(parser).extract(reply)
    assert (extracted.content or None, [(c.name, c.arguments) for c in extracted.calls]) == (content, calls)
    for call in message.tool_calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("parser,prompt,reply,reasoning,content", REASONING_CASES)
def test_reasoning_streams_to_the_non_streamed_message(parser: str, prompt: str, reply: str, reasoning: str | None,
                                                       content: str | None) -> None:
    message = _check_streams(lambda: _parser(None, parser, prompt), reply)
    assert (message.reasoning, message.content) == (reasoning, content)
    extracted = reasoning_parser(parser, prompt).extract(reply)
    assert (extracted.reasoning or None, extracted.content or None) == (reasoning, content)


def test_reasoning_then_tool_calls() -> None:
    reply = (f'<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{{"name": "get_weather", '
             f'"arguments": {WEATHER}}}\n</tool_call>')
    message = _check_streams(lambda: _parser("hermes", "qwen3", "assistant\n"), reply)
    assert message.reasoning == "The user wants the weather." and message.content is None
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_weather", WEATHER)]


def test_no_markup_reaches_the_content_while_streaming() -> None:
    reply = "<think>abc</think>Hi <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
    parser = _parser("hermes", "qwen3", "")
    sent = "".join(parser.feed(char).content for char in reply) + parser.feed("", final=True).content
    assert sent == "Hi "


def test_one_call_when_parallel_calls_are_off() -> None:
    parser = ChoiceParser(None, tool_parser("hermes"), max_calls=1)
    parser.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
                '</tool_call>', final=True)
    assert [c.name for c in parser.message().tool_calls] == ["a"]


def test_mistral_ids_are_nine_alphanumerics() -> None:
    call_id = tool_parser("mistral").new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()


def test_registries_match_the_config_names() -> None:
    assert sorted(TOOL_PARSERS) == sorted(TOOL_CALL_PARSERS)
    assert sorted(REASONING_REGISTRY) == sorted(REASONING_PARSERS)


_PIECES = ['<tool_call>', '</tool_call>', '<think>', '</think>', '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>',
           '<|python_start|>', '<|python_end|>', '{', '}', '[', ']', '(', ')', '"', "'", '\\', ',', ';', ':', '=',
           ' ', '\n', '"name"', '"arguments"', '"parameters"', '"f"', 'f', 'x', '1', 'True', '<', '</']


@pytest.mark.parametrize("tool", sorted(TOOL_PARSERS) + ["forced"])
@pytest.mark.parametrize("reasoning", [None, "qwen3", "deepseek_r1"])
def test_any_text_streams_to_its_non_streamed_reading(tool: str, reasoning: str | None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Random soups of markers and JSON/Python punctuation: malformed replies stream consistently too."""
    rng = random.Random(f"{tool}-{reasoning}")
    for _ in range(60):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 25)))
        whole = _parser(tool, reasoning, "")
        whole.feed(text, final=True)
        for pieces in (list(text), [text[:len(text) // 2], text[len(text) // 2:]]):
            parser = _parser(tool, reasoning, "")
            streamed = _reassemble([parser.feed(p) for p in pieces] + [parser.feed("", final=True)])
            assert _without_ids(streamed) == _without_ids(whole.message()), text
    assert "changed after it was sent" not in caplog.text


def test_a_call_cut_short_keeps_what_was_written() -> None:
    parser = _parser("hermes", None)
    parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', final=True)
    (call,) = parser.message().tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Pa')
