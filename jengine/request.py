"""A request inside the engine core: token ids, progress counters and its own scheduling state (text never enters
the core)."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jengine.lora.request import LoRARequest
    from jengine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed with its generated tokens kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # a set of strings: checked per request per step

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED_VALUES = frozenset(status.value for status in RequestStatus if status.name.startswith("FINISHED_"))


@dataclasses.dataclass(frozen=True, slots=True)
class StopRule:
    """A request's stop conditions folded into a per-step check that is cheap when nothing stops (the common
    case); the scheduler decides exactly once it may."""

    token_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: may stop, depending on min_tokens
    max_num_tokens: int  # prompt + output tokens at which it stops for length (max_tokens or max_model_len)

    @classmethod
    def of(cls, request: Request, max_model_len: int) -> StopRule:
        params = request.sampling_params
        eos = frozenset() if params.ignore_eos else frozenset(request.eos_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        return cls(eos | frozenset(params.stop_token_ids or ()),
                   min(request.num_prompt_tokens + max_tokens, max_model_len))

    def may_stop(self, request: Request) -> bool:
        tokens = request.all_token_ids
        return len(tokens) >= self.max_num_tokens or tokens[-1] in self.token_ids


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated and everything about it the core tracks (the cache manager keeps its block
    table, the runner its device row). `num_computed_tokens` catches up with `num_tokens` step by step.

    Slotted, plain attributes: the scheduler reads several per running request per step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first, as in vLLM; FCFS within a priority
    cache_salt: str | None = None  # isolates prefix-cache sharing (e.g. per tenant)
    choice_index: int = 0  # which of the n choices of its parent request (seeds differ per choice)
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # Structured output: the request's own grammar matcher (structured.masks.RequestGrammar), made in the front and
    # advanced by the core with each accepted token; None for a free request.
    grammar: Any = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache on first scheduling
    # One per full block of known tokens, chained (cache.hashing.hash_blocks); the cache manager extends it.
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    all_token_ids: list[int] = dataclasses.field(init=False)  # prompt + output, kept in step (no copy per access)
    # Set by the scheduler when it admits the request:
    stop_rule: StopRule = dataclasses.field(init=False, repr=False)
    request_counter: int = dataclasses.field(init=False, default=-1)  # engine-unique: seeds unseeded randomness
    lora_slot: int = dataclasses.field(init=False, default=-1)  # the adapter's device slot while admitted
    # Tokens sampled by steps whose outputs have not been applied yet (the pipelined engine runs ahead).
    num_pending_tokens: int = dataclasses.field(init=False, default=0)
    # Prompt-logprob entries received in the current pass over the prompt, and the most ever sent: a preempted
    # request recomputes its prompt, and positions sent once are not sent again.
    prompt_logprobs_received: int = dataclasses.field(init=False, default=0)
    prompt_logprobs_sent: int = dataclasses.field(init=False, default=0)
    # Tokens a proposer guessed after the last step, verified when the request is next scheduled (speculation).
    spec_token_ids: list[int] = dataclasses.field(init=False, default_factory=list)
    # When the core first scheduled it (a resumption after preemption keeps it); reported once, on its first output.
    first_scheduled_time: float | None = dataclasses.field(init=False, default=None)
    first_scheduled_reported: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def report_first_scheduled_time(self) -> float | None:
        """The first scheduling time for the request's first output once it was scheduled; None otherwise."""
        if self.first_scheduled_reported:
            return None
        self.first_scheduled_reported = True
        return self.first_scheduled_time

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
