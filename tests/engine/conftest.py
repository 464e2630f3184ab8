"""A fake engine core (EngineCore's methods, a scripted "model") and the tiny tokenizer, for front-end tests."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from jengine.config import EngineConfig
from jengine.engine.core import EngineCoreOutput
from jengine.request import Request, RequestStatus
from jengine.scheduler.output import TokenLogprobs
from jengine.tokenizer import CHATML_TEMPLATE, Tokenizer, train_tiny_tokenizer

EOS = 2  # the tiny tokenizer's </s>
Script = Callable[[Request, int], Sequence[int]]


def cycle_prompt(request: Request, choice_index: int) -> list[int]:
    """Default script: the prompt's tokens, cycled, shifted by the choice index (so choices differ)."""
    prompt = request.prompt_token_ids
    return [prompt[(k + choice_index) % len(prompt)] for k in range(request.sampling_params.max_tokens or 64)]


@dataclasses.dataclass
class _Running:
    request: Request
    tokens: list[int]
    first_step: bool = True


class FakeCore:
    """EngineCore's interface: each step every running request emits the next token of its script.

    Stop rules are the scheduler's (EOS unless ignore_eos, stop_token_ids, both after min_tokens; max_tokens;
    max_model_len); a script that runs out emits EOS. `paused` freezes progress; `fail_at_step` raises in step().
    """

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 128, script: Script = cycle_prompt,
                 step_delay: float = 0.0, fail_at_step: int | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.script = script
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.paused = threading.Event()
        self.requests: dict[str, _Running] = {}
        self.added: list[str] = []
        self.aborted: list[tuple[str, RequestStatus]] = []
        self.max_held = 0
        self.num_steps = 0
        self.has_unfinished_calls = 0
        self.shut_down = False

    def add_request(self, request: Request, *, enforce_queue_bound: bool = True) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = _Running(request, list(self.script(request, request.choice_index)))
        self.added.append(request.request_id)
        self.max_held = max(self.max_held, len(self.requests))

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
              ) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            running = self.requests.pop(request_id, None)
            if running is not None:
                self.aborted.append((request_id, status))
                outputs.append(EngineCoreOutput(request_id, [], [], None, status.finish_reason, 0, time.monotonic()))
        return outputs

    def has_unfinished(self) -> bool:
        self.has_unfinished_calls += 1
        return bool(self.requests)

    def num_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> dict[str, int]:
        return {"num_running": min(len(self.requests), self.max_num_seqs)}

    def shutdown(self) -> None:
        self.shut_down = True

    def step(self) -> list[EngineCoreOutput]:
        if self.paused.is_set():
            time.sleep(0.002)
            return []
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        return [self._advance(r) for r in list(self.requests.values())[: self.max_num_seqs]]

    def _advance(self, running: _Running) -> EngineCoreOutput:
        request = running.request
        k = request.num_output_tokens
        token = running.tokens[k] if k < len(running.tokens) else EOS
        request.append_output([token])
        status = self._stop_status(request)
        if status is not None:
            del self.requests[request.request_id]
        params = request.sampling_params
        logprobs = [fake_logprobs(token, params.logprobs)] if params.logprobs is not None else []
        prompt_logprobs = None
        if running.first_step and params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [fake_logprobs(t, params.prompt_logprobs) for t in request.prompt_token_ids[1:]]
        running.first_step = False
        finish = status.finish_reason if status else None
        return EngineCoreOutput(request.request_id, [token], logprobs, prompt_logprobs, finish, 0, time.monotonic())

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params, last = request.sampling_params, request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and last in request.eos_token_ids) or last in (params.stop_token_ids or ()):
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= (params.max_tokens or 0) or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def fake_logprobs(token: int, num_top: int) -> TokenLogprobs:
    """The chosen token ranked 2nd after token 10, then tokens 10, 11, ... as the top ones."""
    top = [10 + j for j in range(num_top)]
    return TokenLogprobs([token, *top], [-1.5, *[-0.5 - 0.25 * j for j in range(num_top)]], chosen_rank=2)


@dataclasses.dataclass(frozen=True)
class FakeSpec:
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class FakeParts:
    core: FakeCore
    tokenizer: Tokenizer
    spec: FakeSpec
    config: EngineConfig
    sampling_defaults: dict = dataclasses.field(default_factory=dict)


def make_parts(tokenizer: Tokenizer, core: FakeCore | None = None, *, max_num_seqs: int = 8,
               max_num_queued_reqs: int = 8, max_model_len: int = 128) -> FakeParts:
    """What `build_engine` returns, around a fake core."""
    config = EngineConfig.from_kwargs("fake-model", max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_queued_reqs,
                                      max_model_len=max_model_len)
    core = core or FakeCore(max_num_seqs, max_model_len)
    return FakeParts(core, tokenizer, FakeSpec(tokenizer.vocab_size), config)


@pytest.fixture(scope="session")
def tiny_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root: Path = tmp_path_factory.mktemp("engine_tokenizers")
    return {
        kind: Tokenizer.from_pretrained(train_tiny_tokenizer(root / kind, kind=kind, chat_template=CHATML_TEMPLATE))
        for kind in ("bytelevel", "metaspace")
    }


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    """The byte-level tiny tokenizer (ids 0, 1, 2 = <unk>, <s>, </s>)."""
    return tiny_tokenizers["bytelevel"]
