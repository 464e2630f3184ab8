"""Output processor: text, stop strings across token boundaries, hold-back in deltas, n > 1, vLLM logprob shapes."""

from __future__ import annotations

import pytest

from jengine.engine.core import EngineCoreOutput
from jengine.front.output_processor import OutputProcessor, ProcessedOutputs, find_stop_string
from jengine.outputs import Logprob, RequestOutput, RequestOutputKind
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import TokenLogprobs
from jengine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Hello, world! How are you today? The quick brown fox jumps over the lazy dog."
PROMPT = [1, 5, 6]
DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def _out(child: str, tokens: list[int], finish: str | None = None, t: float = 0.0,
         logprobs: list[TokenLogprobs | None] | None = None,
         prompt_logprobs: list[TokenLogprobs | None] | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(child, tokens, logprobs or [], prompt_logprobs, finish, 0, t)


def _run(tokenizer: Tokenizer, ids: list[int], params: SamplingParams, kind: RequestOutputKind = DELTA,
         finish: str = "length") -> tuple[list[RequestOutput], list[ProcessedOutputs]]:
    """Feed `ids` one token per step to one request ("r"); the last step carries `finish`."""
    proc = OutputProcessor(tokenizer)
    proc.add("r", None, PROMPT, params, ["r"], 0.0, output_kind=kind)
    batches = [proc.process([_out("r", [tok], finish if i == len(ids) - 1 else None)]) for i, tok in enumerate(ids)]
    assert not proc.has_request("r")
    return [o for b in batches for o in b.request_outputs], batches


def _token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds when streamed after PROMPT (the reference for where token boundaries fall)."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    return [detok.push([t]) for t in ids]


def _split_stop(tokenizer: Tokenizer) -> tuple[list[int], str, str, int]:
    """(ids, full text, a 5-char stop string spanning a token boundary, its first position)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = _token_texts(tokenizer, ids)
    full = "".join(pieces)
    boundary = len(pieces[0])
    for piece in pieces[1:]:
        stop = full[boundary - 2 : boundary + 3]
        if boundary >= 2 and len(stop) == 5 and full.find(stop) == boundary - 2 and " " not in stop[:2]:
            assert not any(stop in p for p in pieces)  # no single token holds it
            return ids, full, stop, boundary - 2
        boundary += len(piece)
    raise AssertionError("no stop string across a token boundary")


@pytest.fixture(params=["bytelevel", "metaspace"])
def any_tokenizer(request: pytest.FixtureRequest, tiny_tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    return tiny_tokenizers[request.param]


def test_plain_text_matches_decode(any_tokenizer: Tokenizer) -> None:
    ids = any_tokenizer.encode(TEXT, add_special_tokens=False)
    outputs, _ = _run(any_tokenizer, ids, SamplingParams(max_tokens=len(ids)), CUMULATIVE)
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == "".join(_token_texts(any_tokenizer, ids))
    assert final.outputs[0].token_ids == ids and final.prompt_token_ids == PROMPT
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]


def test_stop_string_across_tokens_trims_and_aborts(any_tokenizer: Tokenizer) -> None:
    ids, full, stop, at = _split_stop(any_tokenizer)
    outputs, batches = _run(any_tokenizer, ids, SamplingParams(stop=[stop, "never here"], max_tokens=len(ids)), FINAL)
    [final] = outputs
    choice = final.outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (full[:at], "stop", stop)
    aborts = [b.requests_to_abort for b in batches if b.requests_to_abort]
    assert aborts == [["r"]]  # once, at the step that completed the stop string; later outputs are ignored
    assert len(choice.token_ids) < len(ids)


def test_stop_string_kept_when_asked(any_tokenizer: Tokenizer) -> None:
    ids, full, stop, at = _split_stop(any_tokenizer)
    params = SamplingParams(stop=stop, include_stop_str_in_output=True, max_tokens=len(ids))
    outputs, _ = _run(any_tokenizer, ids, params, FINAL)
    assert outputs[0].outputs[0].text == full[: at + len(stop)]


def test_deltas_hold_back_a_possible_stop_start(any_tokenizer: Tokenizer) -> None:
    ids, full, stop, at = _split_stop(any_tokenizer)
    outputs, _ = _run(any_tokenizer, ids, SamplingParams(stop=stop, max_tokens=len(ids)), DELTA)
    deltas = [o.outputs[0].text for o in outputs]
    assert "".join(deltas) == full[:at]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert all(stop not in d for d in deltas)


def test_hold_back_released_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outputs, _ = _run(tokenizer, ids, SamplingParams(stop="XYZ!", max_tokens=len(ids)), DELTA)
    pieces = _token_texts(tokenizer, ids)
    before_last, full = "".join(pieces[:-1]), "".join(pieces)
    released_before_finish = "".join(o.outputs[0].text for o in outputs[:-1])
    assert released_before_finish == before_last[: len(before_last) - 3]  # max_stop_len - 1 characters held back
    assert "".join(o.outputs[0].text for o in outputs) == full


def test_cumulative_text_also_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outputs, _ = _run(tokenizer, ids, SamplingParams(stop="XYZ!", max_tokens=len(ids)), CUMULATIVE)
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == "".join(_token_texts(tokenizer, ids))


def test_stop_string_waits_for_min_tokens(tokenizer: Tokenizer) -> None:
    ids, full, stop, at = _split_stop(tokenizer)
    outputs, _ = _run(tokenizer, ids, SamplingParams(stop=stop, min_tokens=len(ids), max_tokens=len(ids)), FINAL)
    assert outputs[0].outputs[0].text == full and outputs[0].outputs[0].finish_reason == "length"


def test_find_stop_string_earliest_and_tail_only() -> None:
    assert find_stop_string("abcdef", 3, ["ef", "cd"], include=False) == ("cd", 2)
    assert find_stop_string("abcdef", 3, ["cd"], include=True) == ("cd", 4)
    assert find_stop_string("abcdef", 1, ["ab"], include=False) is None  # old text is not searched again


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id(tokenizer: Tokenizer, include: bool) -> None:
    ids = tokenizer.encode("Hello, world", add_special_tokens=False)
    stop_id = tokenizer.encode("!", add_special_tokens=False)[0]
    params = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include, max_tokens=50)
    outputs, _ = _run(tokenizer, ids + [stop_id], params, FINAL, finish="stop")
    choice = outputs[0].outputs[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    assert choice.text == ("Hello, world!" if include else "Hello, world")
    assert choice.token_ids[-1] == stop_id


def test_eos_is_not_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    outputs, _ = _run(tokenizer, ids, SamplingParams(skip_special_tokens=False), FINAL, finish="stop")
    choice = outputs[0].outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("Hi there", "stop", None)


def test_n_choices_aggregate(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add("p", "prompt", PROMPT, SamplingParams(n=2), ["p-0", "p-1"], 0.0, output_kind=CUMULATIVE)
    a, b = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("no", add_special_tokens=False)
    first = proc.process([_out("p-0", a, "length"), _out("p-1", b)]).request_outputs
    assert len(first) == 1 and not first[0].finished
    assert [(c.index, c.text, c.finished()) for c in first[0].outputs] == [(0, "yes", True), (1, "no", False)]
    last = proc.process([_out("p-1", [2], "stop")]).request_outputs[0]
    assert last.finished and last.prompt == "prompt" and [c.text for c in last.outputs] == ["yes", "no"]
    assert proc.num_requests() == 0


def test_n_choices_delta_reports_only_news(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add("p", None, PROMPT, SamplingParams(n=2), ["p-0", "p-1"], 0.0, output_kind=DELTA)
    out = proc.process([_out("p-1", tokenizer.encode("no", add_special_tokens=False))]).request_outputs[0]
    assert [(c.index, c.text) for c in out.outputs] == [(1, "no")]


def test_logprobs_in_vllm_shape(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add("r", None, PROMPT, SamplingParams(logprobs=2, prompt_logprobs=1), ["r"], 0.0, output_kind=FINAL)
    chosen_out = TokenLogprobs([50, 10, 11], [-1.5, -0.5, -0.75], chosen_rank=3)
    chosen_top = TokenLogprobs([10, 10, 11], [-0.5, -0.5, -0.75], chosen_rank=1)
    prompt_lps = [None, TokenLogprobs([5, 7], [-2.0, -0.1], 2), TokenLogprobs([6, 6], [-0.2, -0.2], 1)]
    proc.process([_out("r", [50], logprobs=[chosen_out], prompt_logprobs=prompt_lps)])
    [final] = proc.process([_out("r", [10], "length", logprobs=[chosen_top])]).request_outputs
    choice = final.outputs[0]
    text = lambda i: tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    assert choice.logprobs == [
        {50: Logprob(-1.5, 3, text(50)), 10: Logprob(-0.5, 1, text(10)), 11: Logprob(-0.75, 2, text(11))},
        {10: Logprob(-0.5, 1, text(10)), 11: Logprob(-0.75, 2, text(11))},
    ]
    assert list(choice.logprobs[0]) == [50, 10, 11]  # the chosen token first
    assert choice.cumulative_logprob == pytest.approx(-2.0)
    assert final.prompt_logprobs == [None, {5: Logprob(-2.0, 2, text(5)), 7: Logprob(-0.1, 1, text(7))},
                                     {6: Logprob(-0.2, 1, text(6))}]


def test_no_logprobs_unless_asked(tokenizer: Tokenizer) -> None:
    outputs, _ = _run(tokenizer, [40, 41], SamplingParams(), FINAL)
    assert outputs[0].outputs[0].logprobs is None and outputs[0].outputs[0].cumulative_logprob is None
    assert outputs[0].prompt_logprobs is None


def test_metrics_and_unknown_ids(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add("r", None, PROMPT, SamplingParams(), ["r"], 9.0, output_kind=FINAL)
    assert proc.process([_out("someone-else", [40], "length")]).request_outputs == []
    proc.process([_out("r", [40], t=10.0)])
    [final] = proc.process([_out("r", [41], "length", t=11.0)]).request_outputs
    metrics = final.metrics
    assert (metrics.first_token_time, metrics.last_token_time, metrics.finished_time) == (10.0, 11.0, 11.0)
    assert (metrics.ttft, metrics.e2e) == (1.0, 2.0)


def test_abort_finishes_with_abort_reason(tokenizer: Tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add("r", None, PROMPT, SamplingParams(), ["r"], 0.0, output_kind=DELTA)
    proc.process([_out("r", [40])])
    [final] = proc.process([_out("r", [], "abort")]).request_outputs
    assert final.finished and final.outputs[0].finish_reason == "abort" and final.outputs[0].token_ids == []
