"""The step contract between the scheduler and the runner: plain data, a diff against the previous step.

New (and resumed) requests travel in full once; running ones send only their new block ids, and only when they got
some (a decode with room in its last block sends nothing but its count). The runner keeps a persistent batch, its
rows' computed counts included, and applies these deltas. This is the only part of `jengine.scheduler` the runner
imports.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jengine.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # every known token: the prompt, plus generated tokens when resumed after preemption
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hit) before this step
    sampling_params: SamplingParams
    choice_index: int  # which of the n choices of its parent request (seeds differ per choice)
    num_output_tokens: int  # generated tokens among token_ids (resumed requests keep theirs)
    eos_token_ids: frozenset[int]  # banned while min_tokens is not reached
    request_counter: int  # engine-unique number: seeds the randomness of requests without their own seed
    lora_slot: int = -1  # the device slot of its LoRA adapter; -1: the base model


@dataclasses.dataclass(slots=True)
class CachedRequestData:
    """A running request that got new blocks this step. Not frozen: several are built per step, and a frozen
    dataclass's __init__ (object.__setattr__ per field) costs several times more."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]  # running requests with new blocks; a scheduled one absent has none
    num_scheduled_tokens: dict[str, int]  # request id → new tokens this step, in row order (new requests last)
    total_num_scheduled_tokens: int
    finished_request_ids: set[str]  # finished or aborted since the last step: the runner drops their rows
    preempted_request_ids: set[str]  # preempted this step: the runner drops their rows; they come back as new
    # adapters to write into device slots before this step runs (slot → adapter name); the slot held another or none
    lora_loads: dict[int, str] = dataclasses.field(default_factory=dict)
    # Speculation: request id → the draft tokens scheduled after its last token (counted in its scheduled tokens)
    scheduled_spec_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # request id → the blocks it keeps after rejected drafts were rolled back (the runner drops the others)
    kept_blocks: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Raw log-probabilities at one position: the chosen token first, then the top-k (vLLM's shape is built later)."""

    token_ids: list[int]
    logprobs: list[float]
    chosen_rank: int


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    request_ids: list[str]  # rows in the order of `SchedulerOutput.num_scheduled_tokens`
    sampled_token_ids: list[list[int]]  # empty for a request whose prefill chunk did not reach its last token
    logprobs: list[TokenLogprobs | None]  # per row, when the request asked for logprobs and sampled
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]  # per request asking for them: positions of this chunk
    # Speculation: request id → the proposer's guesses of its next tokens (requests that may speculate)
    draft_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
