"""OpenAI request bodies → prompts + `SamplingParams`, with every check done before the request touches the engine.

Strict on purpose: a JSON type that is not the documented one is a 400 naming the field (no "5" for 5, though 5.0 is
5), an unknown field is a 400 (never accepted and ignored), and a known field whose feature this server lacks and that
would change the output (`tool_choice` auto, `suffix`, ...) is a 400 that says so; fields that change nothing
(`user`, `metadata`, ...) are accepted. Caps (n, logprobs, stop, nesting) are enforced here (n, logprobs) or by the
engine's front, which validates SamplingParams once for every front end, before admission.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jengine.clients.protocol import ModelInfo
from jengine.errors import InvalidRequestError
from jengine.sampling.defaults import Api, max_tokens_when_unset
from jengine.sampling.params import SamplingParams
from jengine.tokenizer.chat import check_continuation
from jengine.tools.request import ChatParsing, ToolRequest, parse_tools
from jengine.tools.required import ForcedToolChoice, forced_tool_choice
from server.json_body import json_type
from server.openai.messages import ROLES, normalize_messages
from server.openai.refusals import refusal_message
from server.openai.structured import STRUCTURED_FIELDS, structured_from_body

__all__ = ["ROLES", "normalize_messages"]  # with the parsers below: what the server reads requests with

MAX_LOGPROBS = 20  # OpenAI's top_logprobs cap; the engine's --max-logprobs may lower it
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch (each also needs its own engine slots)
MAX_REQUEST_ID_CHARS = 256
MAX_TOKEN_ID_ENTRIES = 1024  # stop_token_ids and logit_bias: every step checks them, so they stay small

# Accepted and without effect on the output.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                             "prompt_cache_key", "safety_identifier"})
# Typed fields passed straight into SamplingParams (OpenAI's, then vLLM's extras).
NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")
INT_FIELDS = ("n", "seed", "top_k", "min_tokens", "prompt_logprobs")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
          "detokenize")
_SAMPLING = frozenset(NUMBER_FIELDS + INT_FIELDS + BOOL_FIELDS
                      + ("stop", "stop_token_ids", "logit_bias", "max_tokens")) | STRUCTURED_FIELDS
_COMMON = _SAMPLING | HARMLESS_FIELDS | {"model", "stream", "stream_options", "priority", "request_id"}
CHAT_TEMPLATE_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template_kwargs"})
CHAT_FIELDS = _COMMON | CHAT_TEMPLATE_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                "tools", "tool_choice", "include_reasoning"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}


def _off(value: Any) -> bool:
    return value is None


# Known fields whose feature is missing: refused unless the value asks for nothing (predicate true).
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v is None or v == [], "function_call": lambda v: v is None or v == "none",
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _off, "prediction": _off, "reasoning_effort": _off, "web_search_options": _off, "suffix": _off,
    "verbosity": _off,
    # vLLM's extras that change the output, where this server lacks them
    "best_of": lambda v: v is None or v == 1, "truncate_prompt_tokens": _off, "logits_processors": _off,
    "return_tokens_as_token_ids": lambda v: v is None or v is False,
}
# Per endpoint: the value each endpoint always uses is accepted, another one refused.
_CHAT_REFUSED: dict[str, Callable[[Any], bool]] = {
    "add_special_tokens": lambda v: v is None or v is False, "echo": lambda v: v is None or v is False,
}
_COMPLETION_REFUSED: dict[str, Callable[[Any], bool]] = {"add_special_tokens": lambda v: v is None or v is True}


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False  # a final chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's extra: usage so far in every chunk


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[Any]  # one PromptInput per prompt of the batch (text, or {"prompt_token_ids": [...]})
    params: SamplingParams
    stream: bool
    stream_options: StreamOptions
    echo: bool
    logprobs: int | None  # completions-format logprobs (top-k beside the chosen token), None = none
    priority: int
    shown_prompt_logprobs: int | None  # vLLM's prompt_logprobs as asked (echo may compute more; they are not shown)
    request_id: str | None = None  # vLLM's extra: the response id becomes cmpl-<request_id>
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str | None
    prompt: dict[str, Any]  # {"messages": [...], "add_generation_prompt": bool}: rendered after admission
    params: SamplingParams
    stream: bool
    stream_options: StreamOptions
    top_logprobs: int | None  # None: no logprobs; k: chosen token plus the k most likely
    priority: int
    shown_prompt_logprobs: int | None
    request_id: str | None = None  # vLLM's extra: the response id becomes chatcmpl-<request_id>
    tools: ToolRequest | None = None  # the tools and tool_choice, checked
    parsing: ChatParsing | None = None  # how the choices' text is read (reasoning, tool calls); None: as it is
    forced_tools: ForcedToolChoice | None = None  # tool_choice "required" or a named function: the output is calls


# ---------------------------------------------------------------------------------------------------------- fields
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def get_field(body: Mapping[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """`body[name]` if it has JSON type `kind`; absent or null gives `default`; another type is a 400."""
    value = body.get(name)
    if value is None:
        return default
    if kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)  # 2.0 is the integer 2 (JSON has one number type; pydantic-based servers agree)
    check, what = _KINDS[kind]
    if not check(value):
        raise InvalidRequestError(f"{name} must be {what}, got {json_type(value)}", param=name)
    return value


def check_fields(body: Mapping[str, Any], allowed: frozenset[str],
                 refused: Mapping[str, Callable[[Any], bool]] | None = None) -> None:
    """Refuse features this server lacks (`_REFUSED`, and the endpoint's own `refused`), then fields nobody knows:
    neither is ever silently ignored."""
    refused = {**_REFUSED, **(refused or {})}
    for name, harmless in refused.items():
        if name in body and not harmless(body[name]):
            raise InvalidRequestError(refusal_message(name), param=name, code="unsupported_parameter")
    unknown = sorted(k for k in body if k not in allowed and k not in refused)
    if unknown:
        raise InvalidRequestError(f"unrecognized request argument(s): {', '.join(unknown)}"[:300], param=unknown[0],
                                  code="unknown_parameter")


def _stream(body: Mapping[str, Any]) -> tuple[bool, StreamOptions]:
    stream = get_field(body, "stream", "bool", False)
    if stream and body.get("prompt_logprobs") is not None:
        raise InvalidRequestError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    options = get_field(body, "stream_options", "object")
    if options is None:
        return stream, StreamOptions()
    if not stream:
        raise InvalidRequestError("stream_options can only be set when stream is true", param="stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise InvalidRequestError(f"unrecognized stream_options field(s): {', '.join(unknown)}"[:300],
                                  param="stream_options")
    for name in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
        get_field(options, name, "bool")
    return stream, StreamOptions(bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    """The first of `names` present (max_completion_tokens wins over the older max_tokens); None when none is."""
    for name in names:
        value = get_field(body, name, "int")
        if value is not None:
            if value < 1:
                hint = " (0 only with echo on /v1/completions, to score the prompt)" if name == "max_tokens" else ""
                raise InvalidRequestError(f"{name} must be >= 1{hint}, got {value}", param=name)
            return value
    return None


def _sampling_kwargs(body: Mapping[str, Any], max_tokens_names: tuple[str, ...], defaults: Mapping[str, Any],
                     api: Api, forced: ForcedToolChoice | None = None) -> dict[str, Any]:
    """The request's sampling fields; those it leaves unset take the model's `defaults` (its generation config),
    except max_tokens: unset, it is the endpoint's (`max_tokens_when_unset`)."""
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_tokens"}
    for names, kind in ((NUMBER_FIELDS, "number"), (INT_FIELDS, "int"), (BOOL_FIELDS, "bool")):
        for name in names:
            value = get_field(body, name, kind)
            if value is not None:
                kwargs[name] = value
    kwargs["stop"] = _stop(body)
    kwargs["stop_token_ids"] = _int_list(body, "stop_token_ids", MAX_TOKEN_ID_ENTRIES)
    bias = get_field(body, "logit_bias", "object")
    if bias is not None and len(bias) > MAX_TOKEN_ID_ENTRIES:
        raise InvalidRequestError(f"logit_bias takes at most {MAX_TOKEN_ID_ENTRIES} tokens", param="logit_bias")
    kwargs["logit_bias"] = bias or None
    requested = _max_tokens(body, max_tokens_names)
    kwargs["max_tokens"] = max_tokens_when_unset(defaults, api) if requested is None else requested
    kwargs["structured_outputs"] = structured_from_body(body, forced)
    return kwargs


def _stop(body: Mapping[str, Any]) -> str | list[str] | None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return stop
    raise InvalidRequestError(f"stop must be a string or an array of strings, got {json_type(stop)}", param="stop")


def _int_list(body: Mapping[str, Any], name: str, max_len: int | None = None) -> list[int] | None:
    values = get_field(body, name, "list")
    if values is not None and max_len is not None and len(values) > max_len:
        raise InvalidRequestError(f"{name} takes at most {max_len} token ids, got {len(values)}", param=name)
    if values is not None and not all(_KINDS["int"][0](v) for v in values):
        raise InvalidRequestError(f"{name} must be an array of integers", param=name)
    return values


def _build_params(kwargs: dict[str, Any], max_n: int) -> SamplingParams:
    """SamplingParams under this server's own caps, checked here because the response is shaped by them before the
    engine answers: n (up to `max_n`) and prompt_logprobs (OpenAI's 20). Every range is the engine's check, made
    once, before admission, whatever the front end."""
    for name, low, high in (("n", 1, max_n), ("prompt_logprobs", 0, MAX_LOGPROBS)):
        value = kwargs.get(name)
        if value is not None and value > high:
            raise InvalidRequestError(f"{name} must be [{low}, {high}], got {value}", param=name)
    return SamplingParams(**kwargs)


def _priority(body: Mapping[str, Any]) -> int:
    return get_field(body, "priority", "int", 0)


def _request_id(body: Mapping[str, Any]) -> str | None:
    request_id = get_field(body, "request_id", "str")
    if request_id is not None and not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters", param="request_id")
    return request_id


# ---------------------------------------------------------------------------------------------------------- chat
def parse_chat(body: Mapping[str, Any], info: ModelInfo, max_n: int = 16) -> ChatRequest:
    """A /v1/chat/completions body → ChatRequest (every check here; the template is rendered after admission)."""
    check_fields(body, CHAT_FIELDS, _CHAT_REFUSED)
    model = get_field(body, "model", "str")
    stream, options = _stream(body)
    prompt = {"messages": normalize_messages(body.get("messages")), **chat_template_options(body)}
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    forced = forced_tool_choice(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True))
    if tools is not None and tools.tools:
        prompt["tools"] = list(tools.tools)
    kwargs = _sampling_kwargs(body, ("max_completion_tokens", "max_tokens"), info.sampling_defaults, "chat", forced)
    parsing = ChatParsing.plan(info.chat_parsing, tools, constrained=kwargs["structured_outputs"] is not None)
    include_reasoning = get_field(body, "include_reasoning", "bool", True)  # vLLM's; no parser: nothing to drop
    if parsing is not None:
        kwargs["structured_outputs"] = parsing.structured(kwargs["structured_outputs"])
        parsing = dataclasses.replace(parsing, include_reasoning=include_reasoning)
    if parsing is not None and parsing.needs_special_tokens:
        kwargs["skip_special_tokens"] = False  # the format's markers are special tokens: the parser reads them
    top_logprobs = _chat_logprobs(body)
    if top_logprobs is not None:
        kwargs["logprobs"] = top_logprobs
    params = _build_params(kwargs, max_n)
    return ChatRequest(model, prompt, params, stream, options, top_logprobs, _priority(body), params.prompt_logprobs,
                       _request_id(body), tools, parsing, forced)


def chat_template_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's chat-template fields: `add_generation_prompt` (default true), and where given
    `continue_final_message` (continue the last message: needs add_generation_prompt false) and
    `chat_template_kwargs` (extra template variables, e.g. {"enable_thinking": false})."""
    options: dict[str, Any] = {"add_generation_prompt": get_field(body, "add_generation_prompt", "bool", True)}
    if get_field(body, "continue_final_message", "bool", False):
        check_continuation(options["add_generation_prompt"], True)  # early: the 400 before admission
        options["continue_final_message"] = True
    template_kwargs = get_field(body, "chat_template_kwargs", "object")
    if template_kwargs:
        options["chat_template_kwargs"] = template_kwargs
    return options


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k` (0..20); k > 0 without logprobs is a 400, as vLLM's."""
    wanted = get_field(body, "logprobs", "bool", False)
    top = get_field(body, "top_logprobs", "int")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not wanted:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if wanted else None


# ---------------------------------------------------------------------------------------------------------- completions
def parse_completion(body: Mapping[str, Any], info: ModelInfo, max_n: int = 16) -> CompletionRequest:
    """A /v1/completions body → CompletionRequest (a batch of prompts shares one SamplingParams)."""
    check_fields(body, COMPLETION_FIELDS, _COMPLETION_REFUSED)
    model = get_field(body, "model", "str")
    stream, options = _stream(body)
    prompts = completion_prompts(body.get("prompt"))
    echo = get_field(body, "echo", "bool", False)
    echo_only = echo and get_field(body, "max_tokens", "int") == 0
    if echo_only:  # prompt scoring: the engine samples one token, which the response leaves out
        body = {**body, "max_tokens": 1}
    kwargs = _sampling_kwargs(body, ("max_tokens",), info.sampling_defaults, "completions")
    logprobs = get_field(body, "logprobs", "int")
    shown_prompt_logprobs = kwargs.get("prompt_logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        kwargs["logprobs"] = logprobs
        if echo:  # echoed prompt tokens carry their logprobs too
            kwargs["prompt_logprobs"] = max(kwargs.get("prompt_logprobs") or 0, logprobs)
    params = _build_params(kwargs, max_n)
    return CompletionRequest(model, prompts, params, stream, options, echo, logprobs, _priority(body),
                             shown_prompt_logprobs, _request_id(body), echo_only)


def completion_prompts(prompt: Any) -> list[Any]:
    """A string, an array of strings, an array of token ids, or an array of such arrays → a list of prompts."""
    if isinstance(prompt, str):
        return [_text_prompt(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string, array of strings or array of token ids, got "
                                  f"{json_type(prompt) if prompt != [] else 'an empty array'}", param="prompt")
    if all(_KINDS["int"][0](t) for t in prompt):  # one prompt of token ids (its length is the context's business)
        return [{"prompt_token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_text_prompt(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": _token_prompt(p)} for p in prompt]
    raise InvalidRequestError("prompt mixes strings, token ids and arrays", param="prompt")


def _text_prompt(text: str) -> str:
    if not text:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return text


def _token_prompt(ids: list[Any]) -> list[int]:
    if not ids or not all(_KINDS["int"][0](t) for t in ids):
        raise InvalidRequestError("each token-id prompt must be a non-empty array of integers", param="prompt")
    return ids


# ---------------------------------------------------------------------------------------------------------- tokenize
def parse_tokenize(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize: {"prompt"} or {"messages"}; → the checked fields (text or messages, options)."""
    chat = "messages" in body
    allowed = {"model", "add_special_tokens", "return_token_strs"} | (
        {"messages", "tools"} | CHAT_TEMPLATE_FIELDS if chat else {"prompt"})
    check_fields(body, frozenset(allowed))
    out: dict[str, Any] = {
        "model": get_field(body, "model", "str"),
        "add_special_tokens": get_field(body, "add_special_tokens", "bool", not chat),
        "return_token_strs": get_field(body, "return_token_strs", "bool", False),
    }
    if chat:
        out["messages"] = normalize_messages(body["messages"])
        out["chat"] = chat_template_options(body)
        tools = parse_tools(body.get("tools"), "none")
        if tools is not None:
            out["chat"]["tools"] = list(tools.tools)
    else:
        prompt = get_field(body, "prompt", "str")
        if prompt is None:
            raise InvalidRequestError("prompt (a string) or messages is required", param="prompt")
        out["prompt"] = prompt
    return out


def parse_detokenize(body: Mapping[str, Any], vocab_size: int) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize: {"tokens": [ids]} with every id in [0, vocab)."""
    check_fields(body, frozenset({"model", "tokens"}))
    tokens = _int_list(body, "tokens")
    if tokens is None:
        raise InvalidRequestError("tokens (an array of token ids) is required", param="tokens")
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"token id {token} is not in [0, {vocab_size})", param="tokens")
    return get_field(body, "model", "str"), tokens
