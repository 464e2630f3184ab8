"""`PrefixIndex`: the block hashes one engine replica was sent, as a bounded LRU: a front's approximate view of that
replica's prefix cache (the data-parallel router and the notebook API's replicated core both route by it)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

from jengine.errors import ConfigError


class PrefixIndex:
    """Block hashes one replica was sent, least recently sent evicted first (bounded, like the cache it mirrors)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"a prefix index holds at least one block, got capacity {capacity}")
        self.capacity = capacity
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[bytes]:
        """The hashes held, least recently sent first."""
        return iter(self._lru)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` are held (a chained hash commits to its whole prefix)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._lru:
                break
            count += 1
        return count

    def remember(self, hashes: Sequence[bytes]) -> None:
        """Mark `hashes` most recent, the first block last, so eviction takes a prompt's tail before its head (a
        match stops at the first missing block)."""
        for block_hash in reversed(hashes):
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
