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
from jengine.sampling.params import SamplingParams
from jengine.spec_decode.ngram import propose_ngram


def fallback_reason(params: SamplingParams) -> str | None:
    """Why a request decodes without speculation (None: it speculates). Per-token logprobs are one entry per step
    in the step contract; a verification step emits several tokens, so those requests decode plainly."""
    if params.logprobs is not None:
        return "logprobs are reported one step at a time"
    return None


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, token_ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        """Up to `num_speculative_tokens` drafts per row of `token_ids` [rows, width] (row r's first `lengths[r]`
        tokens are known)."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.lookup_min, self.lookup_max = config.prompt_lookup_min, config.lookup_max

    def propose(self, token_ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        return propose_ngram(token_ids, lengths, self.lookup_min, self.lookup_max, self.num_speculative_tokens)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ConfigError(f"speculative method {config.method!r} has no proposer in this runner")
