"""The proposer interface: after a step, guess the next tokens of the requests that may speculate.

The runner calls `propose` once its batch holds every sampled token; the drafts travel to the scheduler in
`RunnerOutput.draft_token_ids`, which schedules them (counted in the token budget) for the target to verify in one
step. Which requests may speculate is decided here, once (`fallback_reason`); the scheduler only shortens drafts
to what the request may still generate.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from jaxtyping import Array

from jengine.config import SpeculativeConfig
from jengine.errors import ConfigError
from jengine.runner.input_batch import InputBatch, StepInputs
from jengine.runner.step import ModelInputs
from jengine.sampling.params import SamplingParams
from jengine.spec_decode.ngram import propose_ngram


def fallback_reason(params: SamplingParams) -> str | None:
    """Why a request decodes without speculation (None: it speculates). Per-token logprobs are one entry per step
    in the step contract, and a grammar's token mask is built for one position at a time; a verification step
    emits several tokens, so those requests decode plainly."""
    if params.logprobs is not None:
        return "logprobs are reported one step at a time"
    if params.structured_outputs is not None:
        return "structured output masks one position at a time"
    return None


class Proposer(Protocol):
    num_speculative_tokens: int
    # The target's hidden states the proposer reads (`StepModel.capture`); None: none, the plain step's program
    hidden_capture: tuple[int, ...] | None

    def observe(self, inputs: ModelInputs, step: StepInputs, hidden: Array | None) -> None:
        """Sees each target step as it is dispatched: its inputs (device-bound and host-side) and the hidden states
        `hidden_capture` asks for (a draft model or an EAGLE head writes its own cache from them)."""
        ...

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Up to `num_speculative_tokens` drafts for each of the persistent batch's `rows`, whose known tokens are
        all in the batch."""
        ...


class NgramProposer:
    hidden_capture = None

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.lookup_min, self.lookup_max = config.prompt_lookup_min, config.lookup_max

    def observe(self, inputs: ModelInputs, step: StepInputs, hidden: Array | None) -> None:
        """Prompt lookup needs nothing from the device."""

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        lengths = batch.num_known[rows]
        return propose_ngram(batch.token_ids[rows, : int(lengths.max())], lengths, self.lookup_min,
                             self.lookup_max, self.num_speculative_tokens)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ConfigError(f"speculative method {config.method!r} has no proposer in this runner")
