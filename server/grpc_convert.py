"""jengine's Python objects ↔ `jengine.v1` messages, both ways, for the gRPC service and the gRPC-backed client.

One module holds both directions so that a round trip is exact by construction: `RequestOutput` deltas are encoded by
the server and rebuilt by `GrpcEngineClient` into the same objects the in-process engine yields (logprob dicts in
vLLM's order included), and `SamplingParams` travel field for field, an unset proto field meaning the Python default.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jengine.clients.protocol import ModelInfo
from jengine.engine.stats import EngineStats
from jengine.front.input_processor import PromptInput
from jengine.errors import InvalidRequestError
from jengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jengine.sampling import defaults as generation_defaults
from jengine.sampling.defaults import max_tokens_when_unset
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer
from jengine.tokenizer.chat import CHAT_PROMPT_KEYS, chat_options, check_messages
from jengine.v1 import jengine_pb2 as pb
from jengine.tools.request import ChatParsing
from server.grpc_tools import (
    MESSAGE_TOOL_KEYS, ChatReader, chat_parsing_fields, chat_parsing_from_proto, fill_message_tool_fields,
    fill_tools, message_tool_fields, tools_option,
)
from server.json_body import parse_json_object
from server.openai.messages import normalize_messages

# SamplingParams fields by how they travel. Optional fields are sent only when not None (or, for those whose default
# is not the zero value, always set on the Python side); plain ones always (zero is their default).
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
               "detokenize")
LIST_FIELDS = ("stop", "stop_token_ids")  # repeated; empty = None
MAP_FIELDS = ("logit_bias",)  # map; empty = None
_SEED_MODULUS = 2**64
_INT64_MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------------- SamplingParams

def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults, except max_tokens (`max_tokens_when_unset`: what the
    context leaves, as for HTTP chats). Validation is the engine's (one code path for every front end)."""
    kwargs: dict[str, Any] = {}
    for name in (*INT_FIELDS, *FLOAT_FIELDS, *BOOL_FIELDS):
        if _has_presence(msg, name) and not msg.HasField(name):
            continue
        kwargs[name] = getattr(msg, name)
    kwargs.setdefault("max_tokens", max_tokens_when_unset({}, "grpc"))
    for name in LIST_FIELDS:
        kwargs[name] = list(getattr(msg, name)) or None
    kwargs["logit_bias"] = dict(msg.logit_bias) or None
    return SamplingParams(**kwargs)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Raises InvalidRequestError (naming the field) for a value the wire cannot carry, as the engine would."""
    msg = pb.SamplingParams()
    for names, check in ((INT_FIELDS, _wire_int), (FLOAT_FIELDS, _wire_float), (BOOL_FIELDS, _wire_bool)):
        for name in names:
            value = getattr(params, name)
            if value is not None:
                setattr(msg, name, check(name, value))
    msg.stop.extend(_wire_list("stop", params.stop, str))
    stop_token_ids = _wire_list("stop_token_ids", params.stop_token_ids, int)
    msg.stop_token_ids.extend(_wire_int("stop_token_ids", t) for t in stop_token_ids)
    for token, bias in _wire_map(params.logit_bias).items():
        msg.logit_bias[_wire_int("logit_bias", token)] = _wire_float("logit_bias", bias)
    return msg


def _has_presence(msg: pb.SamplingParams, name: str) -> bool:
    """Whether the field is proto3 `optional` (unset differs from zero); read from the descriptor, so it follows the
    proto without a second list to keep in step."""
    return msg.DESCRIPTOR.fields_by_name[name].containing_oneof is not None


def _wire_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}", param=name)
    if name == "seed":  # the engine uses seeds modulo 2**64: a uint64 seed travels as the same bits in an int64
        if not -_SEED_MODULUS // 2 <= value < _SEED_MODULUS:  # no 64 bits carry it: refused, as the engine does
            raise InvalidRequestError(f"seed must be [{-_SEED_MODULUS // 2}, {_SEED_MODULUS - 1}], got {value}",
                                      param="seed")
        value %= _SEED_MODULUS
        return value - _SEED_MODULUS if value > _INT64_MAX else value
    if not -(2**31) <= value < 2**31:
        raise InvalidRequestError(f"{name} is out of range, got {value}", param=name)
    return value


def _wire_float(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}", param=name)
    return float(value)


def _wire_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {type(value).__name__}", param=name)
    return value


def _wire_list(name: str, value: Any, item_type: type) -> list[Any]:
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, item_type) and not isinstance(v, bool) for v in items):
        raise InvalidRequestError(f"{name} must be a list of {item_type.__name__}", param=name)
    return items


def _wire_map(value: Any) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    return value


# ------------------------------------------------------------------------------------------------- prompts

def messages_from_proto(msg: pb.ChatMessages) -> list[dict[str, Any]]:
    """Chat messages as the chat template reads them, checked as over HTTP (the same roles and fields)."""
    out = []
    for m in msg.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content, **message_tool_fields(m)}
        if m.HasField("name"):
            message["name"] = m.name
        out.append(message)
    return normalize_messages(out)


def messages_to_proto(messages: Any, add_generation_prompt: Any = True, continue_final_message: Any = False,
                      chat_template_kwargs: Any = None, tools: Any = None) -> pb.ChatMessages:
    """Only what v1 carries (role, content text, name, tool fields; the template options and tools); anything else
    is refused, never dropped. Template kwargs travel as a JSON object."""
    check_messages(messages)
    flags, _ = chat_options({"add_generation_prompt": add_generation_prompt,
                             "continue_final_message": continue_final_message,
                             "chat_template_kwargs": chat_template_kwargs})
    msg = pb.ChatMessages(**flags)
    if chat_template_kwargs:
        try:
            msg.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"chat_template_kwargs must be JSON values: {exc}"[:200],
                                      param="chat_template_kwargs") from None
    for message in messages:
        msg.messages.append(_message_to_proto(message))
    fill_tools(msg, tools)
    return msg


def chat_options_from_proto(msg: pb.ChatMessages) -> dict[str, Any]:
    """The template options of a chat, as the engine's chat prompt dict holds them."""
    options: dict[str, Any] = {
        "add_generation_prompt": msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
        "continue_final_message": msg.continue_final_message,
    }
    if msg.chat_template_kwargs_json:
        options["chat_template_kwargs"] = parse_json_object(msg.chat_template_kwargs_json, "chat_template_kwargs_json",
                                                            param="chat_template_kwargs")
    return options | tools_option(msg)


def _message_to_proto(message: Any) -> pb.ChatMessage:
    if not isinstance(message, Mapping):
        raise InvalidRequestError("each message must be an object", param="messages")
    extra = sorted(str(k) for k in message if k not in ("role", "content", "name", *MESSAGE_TOOL_KEYS))
    if extra:
        raise InvalidRequestError(f"message field(s) {', '.join(extra)[:100]} cannot be sent to a remote engine "
                                  "(jengine.v1 carries role, content, name and the tool fields)", param="messages")
    fields = {k: message.get(k) for k in ("role", "content", "name") if message.get(k) is not None}
    if not all(isinstance(v, str) for v in fields.values()):
        raise InvalidRequestError("message role, content and name must be strings", param="messages")
    msg = pb.ChatMessage(**fields)
    fill_message_tool_fields(msg, message)
    return msg


def prompt_from_request(request: pb.GenerateRequest) -> PromptInput:
    """The oneof prompt as the engine's PromptInput (chats stay unrendered: the engine renders after admission)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "messages":
        chat = request.messages
        return {"messages": messages_from_proto(chat), **chat_options_from_proto(chat)}
    raise InvalidRequestError("set one of text, token_ids or messages", param="prompt")


def fill_prompt(request: pb.GenerateRequest, prompt: PromptInput) -> str | None:
    """Put a PromptInput into the request's oneof; returns the prompt text a token-id prompt came with (the server
    never sees it, so the client restores it in outputs)."""
    if isinstance(prompt, str):
        request.text = prompt
        return None
    if isinstance(prompt, Mapping):
        return _fill_mapping(request, prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        request.token_ids.ids.extend(_wire_int("prompt_token_ids", t) for t in prompt)
        return None
    raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}",
                              param="prompt")


def _fill_mapping(request: pb.GenerateRequest, prompt: Mapping[str, Any]) -> str | None:
    if "messages" in prompt:
        _refuse_keys(prompt, CHAT_PROMPT_KEYS)
        request.messages.CopyFrom(messages_to_proto(
            prompt["messages"], prompt.get("add_generation_prompt", True), prompt.get("continue_final_message", False),
            prompt.get("chat_template_kwargs"), prompt.get("tools")))
        return None
    _refuse_keys(prompt, ("prompt", "prompt_token_ids"))
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError("prompt must be a string", param="prompt")
    if "prompt_token_ids" in prompt:
        fill_prompt(request, _token_list(prompt["prompt_token_ids"]))
        return text
    if text is None:
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
    request.text = text
    return None


def _refuse_keys(prompt: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(k) for k in prompt if k not in allowed)
    if unknown:
        raise InvalidRequestError(f"unsupported prompt field(s): {', '.join(unknown)[:200]}", param="prompt")


def _token_list(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence):
        raise InvalidRequestError("prompt_token_ids must be a list of integers", param="prompt_token_ids")
    return list(ids)


# ------------------------------------------------------------------------------------------------- outputs

def logprob_to_proto(entry: Mapping[int, Logprob] | None, prompt_token: int, num_top: int) -> pb.TokenLogprob:
    """vLLM's dict (chosen token first, then the top ones) → TokenLogprob; None (nothing predicts the first prompt
    token) → rank 0. `top_logprobs` lists the top `num_top` in rank order, the chosen one included if it is there."""
    if entry is None:
        return pb.TokenLogprob(token_id=prompt_token)
    (chosen_id, chosen), *others = entry.items()
    msg = pb.TokenLogprob(token_id=chosen_id, logprob=chosen.logprob, rank=chosen.rank or 0,
                          token=chosen.decoded_token or "")
    tops = list(others) + ([(chosen_id, chosen)] if chosen.rank is not None and chosen.rank <= num_top else [])
    for token_id, lp in sorted(tops, key=lambda item: item[1].rank or 0):
        msg.top_logprobs.append(pb.TopLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank or 0,
                                              token=lp.decoded_token or ""))
    return msg


def logprob_from_proto(msg: pb.TokenLogprob, *, prompt: bool = False) -> dict[int, Logprob] | None:
    """The inverse: the chosen token first, then the top ones not already there (vLLM's order, exactly)."""
    if prompt and msg.rank == 0 and not msg.top_logprobs:
        return None
    out = {msg.token_id: Logprob(msg.logprob, msg.rank or None, msg.token)}
    for top in msg.top_logprobs:
        out.setdefault(top.token_id, Logprob(top.logprob, top.rank or None, top.token))
    return out


class OutputEncoder:
    """Server side of one stream: RequestOutput deltas → GenerateResponse, with the running usage counts."""

    def __init__(self, params: SamplingParams, parsing: ChatParsing | None = None) -> None:
        """`parsing`: a chat whose replies the server reads; each delta then carries its `chat` reading."""
        self._reader = None if parsing is None else ChatReader(parsing)
        self._prompt: str | None = None
        self._num_top = params.logprobs or 0
        self._num_prompt_top = params.prompt_logprobs or 0
        self._first = True
        self._completion_tokens = 0
        self._prompt_positions = 0  # prompt-logprob positions already sent

    def encode(self, out: RequestOutput) -> pb.GenerateResponse:
        self._completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        msg = pb.GenerateResponse(request_id=out.request_id, finished=out.finished, usage=pb.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=self._completion_tokens,
            cached_tokens=out.num_cached_tokens))
        self._prompt = out.prompt if out.prompt is not None else self._prompt
        msg.outputs.extend(self._choice(c) for c in out.outputs)
        if self._first:
            self._first = False
            msg.prompt_token_ids.extend(out.prompt_token_ids)
            if out.prompt is not None:
                msg.prompt = out.prompt
        for entry in out.prompt_logprobs or ():
            token = out.prompt_token_ids[self._prompt_positions]
            msg.prompt_logprobs.append(logprob_to_proto(entry, token, self._num_prompt_top))
            self._prompt_positions += 1
        return msg

    def _choice(self, choice: CompletionOutput) -> pb.CompletionDelta:
        msg = pb.CompletionDelta(index=choice.index, token_ids=choice.token_ids, text=choice.text,
                                 finish_reason=choice.finish_reason or "")
        msg.logprobs.extend(logprob_to_proto(e, 0, self._num_top) for e in choice.logprobs or ())
        if choice.cumulative_logprob is not None:
            msg.cumulative_logprob = choice.cumulative_logprob
        if isinstance(choice.stop_reason, str):
            msg.stop_str = choice.stop_reason
        elif isinstance(choice.stop_reason, int):
            msg.stop_token_id = choice.stop_reason
        if self._reader is not None:
            msg.chat.CopyFrom(self._reader.read(choice, self._prompt))
        return msg


class OutputDecoder:
    """Client side of one stream: GenerateResponse → the RequestOutput delta the in-process engine would yield.

    Metrics are the client's own clock (arrival = the call), so latency figures include the network hop.
    """

    def __init__(self, params: SamplingParams, prompt_text: str | None) -> None:
        self._wants_logprobs = params.logprobs is not None
        self._prompt = prompt_text
        self._prompt_token_ids: list[int] = []
        self._num_cached_tokens = 0
        self._finished: set[int] = set()  # choice indices already sent with a finish_reason
        self._metrics = RequestMetrics(time.monotonic())

    def decode(self, msg: pb.GenerateResponse) -> RequestOutput:
        if msg.prompt_token_ids:
            self._prompt_token_ids = list(msg.prompt_token_ids)
        if msg.HasField("prompt"):
            self._prompt = msg.prompt
        self._update_metrics(msg)
        self._num_cached_tokens = msg.usage.cached_tokens
        prompt_logprobs = [logprob_from_proto(e, prompt=True) for e in msg.prompt_logprobs] or None
        outputs = [self._choice(c) for c in msg.outputs]
        self._finished.update(c.index for c in outputs if c.finish_reason is not None)
        return RequestOutput(msg.request_id, self._prompt, self._prompt_token_ids, prompt_logprobs, outputs,
                             msg.finished, self._num_cached_tokens, self._metrics)

    def aborted(self, request_id: str, n: int) -> RequestOutput:
        """The last output of a stream cut short by `abort`: every unfinished choice ends with "abort", as the
        in-process engine ends an aborted request."""
        self._metrics.finished_time = time.monotonic()
        outputs = [CompletionOutput(i, "", [], None, [] if self._wants_logprobs else None, "abort")
                   for i in range(n) if i not in self._finished]
        return RequestOutput(request_id, self._prompt, self._prompt_token_ids, None, outputs, True,
                             self._num_cached_tokens, self._metrics)

    def _choice(self, msg: pb.CompletionDelta) -> CompletionOutput:
        logprobs = [logprob_from_proto(e) for e in msg.logprobs] if self._wants_logprobs else None
        kind = msg.WhichOneof("stop_reason")
        return CompletionOutput(msg.index, msg.text, list(msg.token_ids),
                                msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None,
                                logprobs, msg.finish_reason or None,  # type: ignore[arg-type]
                                getattr(msg, kind) if kind else None)

    def _update_metrics(self, msg: pb.GenerateResponse) -> None:
        now = time.monotonic()
        if any(c.token_ids for c in msg.outputs):
            if self._metrics.first_token_time is None:
                self._metrics.first_token_time = now
            self._metrics.last_token_time = now
        if msg.finished:
            self._metrics.finished_time = now


# ------------------------------------------------------------------------------------------------- model, tokenizer

def model_info_to_proto(info: ModelInfo, tokenizer: Tokenizer) -> pb.GetModelInfoResponse:
    tok = pb.TokenizerInfo(vocab_size=tokenizer.vocab_size, eos_token_ids=sorted(tokenizer.eos_token_ids),
                           all_special_ids=tokenizer.all_special_ids, has_chat_template=tokenizer.has_chat_template)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name) is not None:
            setattr(tok, name, getattr(tokenizer, name))
    return pb.GetModelInfoResponse(name=info.name, path=info.path, max_model_len=info.max_model_len,
                                   vocab_size=info.vocab_size, max_logprobs=info.max_logprobs, tokenizer=tok,
                                   sampling_defaults=info.sampling_defaults, aliases=info.aliases,
                                   max_in_flight=info.max_in_flight, **chat_parsing_fields(info.chat_parsing))


def model_info_from_proto(msg: pb.GetModelInfoResponse) -> ModelInfo:
    kinds = {target: kind for target, kind in generation_defaults.FIELDS.values()}
    defaults = {name: kinds.get(name, float)(value) for name, value in msg.sampling_defaults.items()}
    return ModelInfo(msg.name, msg.path, msg.max_model_len, msg.vocab_size, msg.max_logprobs, defaults,
                     tuple(msg.aliases), msg.max_in_flight, chat_parsing_from_proto(msg))


def stats_to_proto(stats: EngineStats) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(**{name: getattr(stats, name) for name in pb.GetStatsResponse.DESCRIPTOR.fields_by_name})


def stats_from_proto(msg: pb.GetStatsResponse) -> EngineStats:
    return EngineStats(**{name: getattr(msg, name) for name in pb.GetStatsResponse.DESCRIPTOR.fields_by_name})
