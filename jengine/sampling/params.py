"""User-facing sampling parameters: vLLM's names and defaults, checked on the host before any work is done.

Host only: this module imports nothing from jax, so servers and the input processor can validate requests cheaply.
The constructor only canonicalises types where that loses nothing (`stop` → tuple, `top_k=-1` → 0, JSON string keys
of `logit_bias` → int); every range check lives in `validate`, which names the offending field, so one code path
reports every bad request as a 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jengine.errors import InvalidRequestError
from jengine.structured.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
MAX_STOP_STRINGS = 64  # OpenAI caps `stop` at 4, vLLM not at all; eval harnesses send a dozen and more
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value is [-100, 100]
_SEED_LOW, _SEED_HIGH = -(2**63), 2**64  # any 64-bit seed, signed or not


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token and when to stop; fields, meanings and defaults are vLLM's."""

    n: int = 1  # independent completions (choices) of one prompt
    temperature: float = 1.0  # softmax temperature; below SAMPLING_EPS (e.g. 0) means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off (-1 is accepted and stored as 0)
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0 = off
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence from the logit of every generated token
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output; 1 = off
    seed: int | None = None  # makes this request's sampling reproducible whatever else is batched with it
    stop: str | tuple[str, ...] | list[str] | None = None  # stop strings (≤ MAX_STOP_STRINGS); stored as a tuple
    stop_token_ids: tuple[int, ...] | list[int] | None = None  # token ids that end the output; stored as a tuple
    ignore_eos: bool = False  # keep generating past the EOS token
    max_tokens: int | None = 16  # generated-token limit; None = up to the context limit (the engine resolves it)
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    logprobs: int | None = None  # top log-probabilities to return per generated token (0 = the chosen one only)
    prompt_logprobs: int | None = None  # same, for each prompt token
    logit_bias: dict[int, float] | None = None  # token id → added to its logit; JSON string keys become int
    skip_special_tokens: bool = True  # drop special tokens from the detokenized text
    spaces_between_special_tokens: bool = True  # detokenizer option, as in vLLM
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    detokenize: bool = True  # produce text at all (token ids are always returned)
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a schema, regex, grammar...

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # the dataclass is frozen; canonicalise once here
        set_(self, "stop", _as_tuple(self.stop, scalar_type=str))
        set_(self, "stop_token_ids", _as_tuple(self.stop_token_ids, scalar_type=int))
        if self.top_k == -1:
            set_(self, "top_k", 0)
        if isinstance(self.logit_bias, Mapping):
            set_(self, "logit_bias", _int_keys(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax and skip temperature, top-k/top-p/min-p and randomness."""
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy, with `changes` applied (vLLM's clone; these params are immutable, so a change is a copy)."""
        return dataclasses.replace(self, **changes)

    def validate(self, vocab_size: int, max_logprobs: int = 20, max_n: int = 16) -> None:
        """Raise InvalidRequestError(param=<field>) for the first field outside vLLM's/OpenAI's ranges."""
        _check_int("n", self.n, 1, max_n)
        _check_real("temperature", self.temperature, 0.0, math.inf)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        self._validate_lengths()
        _check_optional_int("logprobs", self.logprobs, 0, max_logprobs)
        _check_optional_int("prompt_logprobs", self.prompt_logprobs, 0, max_logprobs)
        _check_stop(self.stop)
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        _check_logit_bias(self.logit_bias, vocab_size)
        if self.seed is not None:
            _check_int("seed", self.seed, _SEED_LOW, _SEED_HIGH - 1)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs must be StructuredOutputsParams",
                                          param="structured_outputs")
            self.structured_outputs.validate()

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)


def _as_tuple(value: Any, *, scalar_type: type) -> Any:
    """None → (), a lone scalar → 1-tuple, a list → tuple; anything else is left for `validate` to report."""
    if value is None:
        return ()
    if isinstance(value, scalar_type) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _int_keys(bias: Mapping[Any, Any]) -> Any:
    """Convert JSON string keys ("42") to int; left as given when a key is not an integer or two keys collide."""
    out: dict[int, Any] = {}
    for key, value in bias.items():
        token = _token_key(key)
        if token is None or token in out:
            return dict(bias)
        out[token] = value
    return out


def _token_key(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    digits = key.strip().lstrip("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit() and len(digits) <= 20:  # "²" is a digit to isdigit, not to int
        return int(key)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}", param=name)


def _check_optional_int(name: str, value: Any, low: int, high: int) -> None:
    if value is not None:
        _check_int(name, value, low, high)


def _check_real(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    """Finite number in [low, high] (or (low, high] when low_open); NaN and ±inf are refused."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}", param=name)
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)


def _check_stop(stop: Any) -> None:
    if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    if any(s == "" for s in stop):
        raise InvalidRequestError("stop strings must not be empty", param="stop")


def _check_token_ids(name: str, ids: Any, vocab_size: int) -> None:
    if not isinstance(ids, tuple):
        raise InvalidRequestError(f"{name} must be a list of token ids", param=name)
    for token in ids:
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{name} holds {token!r}, not a token id in [0, {vocab_size})", param=name)


def _check_logit_bias(bias: Any, vocab_size: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    seen: set[int] = set()
    for key, value in bias.items():
        token = _token_key(key)
        if token is None or not 0 <= token < vocab_size or token in seen:
            raise InvalidRequestError(
                f"logit_bias key {str(key)[:32]!r} is not a distinct token id in [0, {vocab_size})", param="logit_bias"
            )
        seen.add(token)
        _check_real("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
