"""The scheduler's side of speculative decoding: drafts fitted to a request's limits, and the acceptance counters
(vLLM's `spec_decode_*` metrics). Pure host Python."""

from __future__ import annotations

import dataclasses

from jengine.request import Request


@dataclasses.dataclass
class SpecDecodeCounts:
    """Cumulative, with vLLM's meanings: a draft is one request's proposal verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # drafts whose position i was accepted

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def drafts_to_schedule(request: Request, budget: int) -> list[int]:
    """The request's drafts that fit this step: after its one new token, within the budget, and no more than it may
    still generate (the tokens after acceptance never pass its length limit). Consumes them."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    room = min(budget - 1, request.stop_rule.max_num_tokens - len(request.all_token_ids) - 1)
    return drafts[: max(room, 0)]
