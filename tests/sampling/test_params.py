"""SamplingParams: vLLM's defaults, canonical types, and validation errors that name their field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from jengine.errors import InvalidRequestError
from jengine.sampling.params import SamplingParams

VOCAB = 100


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, (), (), False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.logit_bias) == (16, 0, None, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    p.validate(VOCAB)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1, logit_bias={"5": 1.5, 7: -2})
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.top_k == 0
    assert p.logit_bias == {5: 1.5, 7: -2}
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    again = dataclasses.replace(p, max_tokens=None)  # how the engine resolves max_tokens: stays canonical
    assert again.stop == ("###",) and again.logit_bias == {5: 1.5, 7: -2} and again.max_tokens is None
    again.validate(VOCAB)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (0, True), (1e-6, True), (1e-5, False), (0.7, False)]
)
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=16), dict(temperature=0), dict(temperature=2.5), dict(top_p=1e-3), dict(top_k=1), dict(top_k=10**6),
        dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2), dict(repetition_penalty=0.1),
        dict(max_tokens=None, min_tokens=1000), dict(max_tokens=1), dict(min_tokens=16), dict(logprobs=0),
        dict(logprobs=20), dict(prompt_logprobs=0), dict(stop=[f"s{i}" for i in range(64)]),
        dict(stop_token_ids=[0, 99]),
        dict(logit_bias={0: -100, "99": 100.0}), dict(seed=0), dict(seed=-(2**63)), dict(seed=2**64 - 1),
    ],
)
def test_valid_edges(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs).validate(VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(n=0), "n"),
        (dict(n=17), "n"),
        (dict(n=1.0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(stop=[f"s{i}" for i in range(65)]), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop=["a", ""]), "stop"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=3), "stop"),
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["1"]), "stop_token_ids"),
        (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (dict(logit_bias={"-1": 1.0}), "logit_bias"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias"),
        (dict(logit_bias={"1": 1.0, 1: 2.0}), "logit_bias"),
        (dict(logit_bias={1: 100.5}), "logit_bias"),
        (dict(logit_bias={1: -101}), "logit_bias"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(seed=True), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_invalid_names_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate(VOCAB)
    assert info.value.param == param
    assert info.value.code == "invalid_value"


def test_caps_are_arguments() -> None:
    SamplingParams(n=32, logprobs=50).validate(VOCAB, max_logprobs=50, max_n=32)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logprobs=5).validate(VOCAB, max_logprobs=4)
    assert info.value.param == "logprobs"


def test_error_message_is_bounded() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={"x" * 10_000: 1.0}).validate(VOCAB)
    assert len(str(info.value)) < 200


def test_importing_params_does_not_import_jax() -> None:
    code = "import sys, jengine.sampling.params, jengine.sampling; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
