"""A request inside the engine core: token ids and progress counters only (text never enters the core)."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence being generated. `num_computed_tokens` catches up with `num_tokens` step by step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first, as in vLLM; FCFS within a priority
    cache_salt: str | None = None  # isolates prefix-cache sharing (e.g. per tenant)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache on first scheduling
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # one per full block of known tokens
    num_preemptions: int = 0
    all_token_ids: list[int] = dataclasses.field(init=False)  # prompt + output, kept in step (no copy per access)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

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
