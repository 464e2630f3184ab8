"""The core's side of a grammar that waits for the end of a reasoning span: with fake token ids for the end marker and
a scripted runner, the row is free (no mask source at all when every token has been applied) until the marker's
tokens have all been sampled, split across steps or not; then the matcher consumes exactly the tokens after it and
every later step masks the row with the grammar's allowed tokens. Serial and pipelined cores agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jengine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from jengine.engine.core import EngineCore
from jengine.request import Request
from jengine.runner.protocol import TokenMaskSource
from jengine.sampling.params import SamplingParams, StructuredOutputsParams
from jengine.scheduler.output import RunnerOutput, SchedulerOutput
from jengine.structured.masks import RequestGrammar
from jengine.structured.source import GrammarSource
from jengine.tokenizer import Tokenizer

MARKER = (7, 8)  # fake ids of the reasoning's end marker
EOS = 2


class ScriptedRunner:
    """Samples each request's scripted tokens in order; records, per step, whether a mask source came and which of
    the request's tokens its mask allowed (None: the row was not masked)."""

    def __init__(self, script: dict[str, list[int]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.steps: list[tuple[bool, dict[str, np.ndarray | None]]] = []
        self._queue: list[RunnerOutput] = []

    def execute(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> RunnerOutput:
        self.dispatch(sched, token_masks)
        return self.fetch(None)

    def dispatch(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> Any:
        masks = None if token_masks is None else token_masks()
        ids = list(sched.num_scheduled_tokens)
        rows: dict[str, np.ndarray | None] = {request_id: None for request_id in ids}
        if masks is not None:
            for row, words in zip(*masks):
                rows[ids[row]] = words
        self.steps.append((token_masks is not None, rows))
        self._queue.append(RunnerOutput(ids, [[self.script[i].pop(0)] for i in ids], [None] * len(ids), {}))
        return object()

    def fetch(self, step: Any) -> RunnerOutput:
        return self._queue.pop(0)

    def shutdown(self) -> None:
        pass


def _allows(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer_dir) -> tuple[GrammarSource, list[int]]:
    tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "42"]
    return GrammarSource(tokenizer), digits


def _run(grammars: tuple[GrammarSource, list[int]], pipelined: bool, reasoning: list[int]
         ) -> tuple[ScriptedRunner, Request]:
    source, digits = grammars
    params = SamplingParams(max_tokens=32, structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
    grammar = source.for_request(params.structured_outputs, MARKER)
    request = Request("r", [5, 6, 9], params, frozenset({EOS}), grammar=grammar)
    free = Request("free", [5], SamplingParams(max_tokens=len(reasoning) + 3), frozenset({EOS}))
    runner = ScriptedRunner({"r": reasoning + digits + [EOS] * 4, "free": [11] * 64})  # pipelined: one more step
    config = EngineConfig(ModelConfig(model="unused"), CacheConfig(), SchedulerConfig(max_model_len=64),
                          ParallelConfig(), RunnerConfig(async_scheduling=pipelined))
    core = EngineCore(config, runner, num_blocks=16)
    core.add_request(request)
    core.add_request(free)
    while core.has_unfinished():
        core.step()
    return runner, request


@pytest.mark.parametrize("reasoning", [
    [3, 7, 9, 7, 8],  # a false start of the marker, then the marker split over two steps
    [7, 8],  # the marker first: nothing free but the marker itself
])
def test_the_grammar_applies_after_the_marker(grammars: tuple[GrammarSource, list[int]], reasoning: list[int]
                                              ) -> None:
    _, digits = grammars
    serial, request = _run(grammars, pipelined=False, reasoning=reasoning)
    assert request.output_token_ids == reasoning + digits + [EOS] and request.status.finish_reason == "stop"
    assert request.grammar.active and request.grammar.matcher.is_stopped()  # fed the digits and EOS only
    steps = serial.steps
    # While reasoning, every token applied: no mask source at all (the free step); the free row is never masked.
    assert [given for given, _ in steps[:len(reasoning)]] == [False] * len(reasoning)
    for _, rows in steps[len(reasoning):]:
        assert rows.get("free") is None
    first = steps[len(reasoning)][1]["r"]
    assert first is not None and _allows(first, digits[0]) and not _allows(first, MARKER[0])
    assert not _allows(steps[len(reasoning) + 2][1]["r"], digits[0])  # two digits done: only EOS
    pipelined, piped_request = _run(grammars, pipelined=True, reasoning=reasoning)
    assert piped_request.output_token_ids == request.output_token_ids
    # Pipelined, a step in flight may end the span, so the source comes, but fills no row until the marker is in.
    # (its last step, for a request the step before it finished, is discarded)
    masked = [rows["r"] is not None for _, rows in pipelined.steps if "r" in rows]
    expected = [rows["r"] is not None for _, rows in steps]
    assert masked[:len(expected)] == expected == [False] * len(reasoning) + [True] * 3


def test_after_reasoning_yields_the_tokens_past_the_marker() -> None:
    grammar = RequestGrammar(matcher=None, vocab_words=1, kind="regex", reasoning_end=(7, 8, 9))
    assert list(grammar.after_reasoning([7, 8])) == [] and not grammar.active
    assert list(grammar.after_reasoning([7, 7, 8])) == [] and not grammar.active  # the last 7, 8 wait for a 9
    assert list(grammar.after_reasoning([9, 4, 5])) == [4, 5] and grammar.active
    assert list(grammar.after_reasoning([7, 8, 9])) == [7, 8, 9]  # active: every token is the grammar's
