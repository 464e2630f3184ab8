"""The data-parallel routing rule, shared by the HTTP front's `Router` and the notebook API's `ReplicatedCore`.

Cache affinity within a load bound. Each replica is scored by the leading run of the prompt's KV blocks it holds (as
far as the front knows: what it sent there), counted in whole blocks, so a difference under one block is a tie; ties
go to the least loaded replica (running + waiting), then to the one chosen longest ago. The replica with the longest
run keeps the request only while its load exceeds the least loaded one's by at most max(4, 25 % of that load);
beyond that bound the next best replica within it takes the request.

Why the bound: every chat prompt starts with its template's header (16+ tokens, a full block), so by the run alone
the first replica to see a chat would keep every chat: the others never receive the header, never cache it, and the
runs never tie. With the bound, a request spills over to a less loaded replica, which then caches the header too, and
from there on the runs tie and load decides. A long shared system prompt still goes where it is cached while the
loads stay within the bound. (SGLang's router overrides cache affinity with a balance threshold too; its defaults
are too loose for a few dozen requests in flight: this one spreads 16.)

Pure Python over integers: no jax, no tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jengine.cache.prefix_index import PrefixIndex

AFFINITY_SLACK_REQUESTS = 4  # the preferred replica may hold this many requests more than the least loaded one...
AFFINITY_SLACK_FRACTION = 0.25  # ...or this fraction of the least loaded one's load, whichever is more


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What the rule knows of one replica for one prompt."""

    matched_blocks: int  # leading blocks of the prompt the replica holds
    load: int  # requests running + waiting there
    last_chosen: int = -1  # when it was last chosen (a counter): of equals, the one chosen longest ago goes first
    available: bool = True  # False: unhealthy, never ranked


def affinity_slack(least_load: int) -> int:
    """How many requests more than the least loaded replica the preferred one may hold and keep its affinity."""
    return max(AFFINITY_SLACK_REQUESTS, int(least_load * AFFINITY_SLACK_FRACTION))


def rank(candidates: Sequence[Candidate]) -> list[int]:
    """Positions of the available candidates, best first (the next ones are where to go when the first refuses):
    those within the load bound by longest run, then load, then the one chosen longest ago; then the rest by load."""
    available = [i for i, c in enumerate(candidates) if c.available]
    if not available:
        return []
    bound = min(candidates[i].load for i in available)
    bound += affinity_slack(bound)

    def key(i: int) -> tuple[int, int, int, int]:
        c = candidates[i]
        within = c.load <= bound
        return (0 if within else 1, -c.matched_blocks if within else 0, c.load, c.last_chosen)

    return sorted(available, key=key)


class ReplicaAffinity:
    """The state the rule reads, per replica: the block hashes the front sent it (a bounded LRU, its approximate view
    of that replica's prefix cache) and when it was last chosen."""

    def __init__(self, capacities: Sequence[int]) -> None:
        """`capacities`: each replica's index bound in blocks (its KV pool size, where known)."""
        self.indexes = [PrefixIndex(capacity) for capacity in capacities]
        self._last_chosen = [-1] * len(self.indexes)
        self._choices = 0

    def rank(self, hashes: Sequence[bytes], loads: Sequence[int], available: Sequence[bool] | None = None
             ) -> list[int]:
        """Replica positions for a prompt with these block hashes, best first (`rank` over what is remembered)."""
        healthy = available if available is not None else [True] * len(self.indexes)
        return rank([Candidate(index.match(hashes), load, last, ok) for index, load, last, ok in
                     zip(self.indexes, loads, self._last_chosen, healthy, strict=True)])

    def chose(self, position: int, hashes: Sequence[bytes]) -> None:
        """Record that the prompt with these block hashes was sent to replica `position`."""
        self.indexes[position].remember(hashes)
        self._last_chosen[position] = self._choices
        self._choices += 1
