"""The proposer interface: after a step, guess the next tokens of the requests that may speculate.

The runner calls `propose` once its batch holds every sampled token; the drafts travel to the scheduler in
`RunnerOutput.draft_token_ids`, which schedules them (counted in the token budget) for the target to verify in one
step. Which requests may speculate is decided here, once (`fallback_reason`); the scheduler only shortens drafts
to what the request may still generate.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jengine.config import SpeculativeConfig
from jengine.errors import ConfigError
from jengine.runner.input_batch import InputBatch
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

    def observe(self, inputs: ModelInputs) -> None:
        """Sees each target step's inputs as it is dispatched (a draft model mirrors them into its own cache)."""
        ...

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Up to `num_speculative_tokens` drafts for each of the persistent batch's `rows`, whose known tokens are
        all in the batch."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.lookup_min, self.lookup_max = config.prompt_lookup_min, config.lookup_max

    def observe(self, inputs: ModelInputs) -> None:
        """Prompt lookup needs nothing from the device."""

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        lengths = batch.num_known[rows]
        return propose_ngram(batch.token_ids[rows, : int(lengths.max())], lengths, self.lookup_min,
                             self.lookup_max, self.num_speculative_tokens)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ConfigError(f"speculative method {config.method!r} has no proposer in this runner")
