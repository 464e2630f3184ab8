"""Per-request block lists over a `BlockPool`: prefix lookup, slot allocation, freeing (host integers only).

The scheduler asks two questions here: "how much of this request is already cached?" (`get_computed_blocks`) and
"can this request grow by N tokens?" (`allocate_slots`, which either allocates or changes nothing). The manager
reads a request's tokens and counters and appends to its `block_hashes`; it never moves `num_computed_tokens`,
which stays the scheduler's to advance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jengine.cache.block_pool import BlockPool
from jengine.cache.hashing import update_block_hashes
from jengine.request import Request


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens, once per scheduling of a request (a resumed preemption counts
    again: its recomputation really does query the cache, and hits there are work saved)."""

    requests: int = 0  # schedulings that queried the cache
    queries: int = 0  # tokens of those requests when they were scheduled
    hits: int = 0  # of which were served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests + 1, self.queries + num_tokens, self.hits + num_hits)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns each request's list of block ids; the pool below owns reference counts and the hash map."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}
        # Leading blocks of each request already offered to the hash map: caching work is O(new full blocks).
        self._num_cached_blocks: dict[str, int] = {}
        # Tokens each request can hold with nothing to allocate and no block newly full (see `has_room`).
        self._room: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (vLLM's `kv_cache_usage_perc`; cached free blocks are free)."""
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative since start-up (callers diff snapshots for rates over a window)."""
        return self._stats

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for a request holding none)."""
        return list(self._blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached run of the request's leading full blocks, and the number of tokens it covers.

        Capped at `num_tokens - 1` tokens rounded down to whole blocks: the model must still run the last token to
        produce logits, so a fully cached prompt recomputes its last block. Takes no references: pass the blocks
        to `allocate_slots` in the same step, before anything else allocates. ([], 0) when caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` more fit the request's blocks with nothing to allocate and no block newly full:
        then `allocate_slots` would return [] and change nothing, so the scheduler skips it (the common decode)."""
        return request.num_computed_tokens + num_new_tokens <= self._room.get(request.request_id, -1)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's blocks to cover its computed tokens, the prefix hit and `num_new_tokens` more.

        Returns the newly allocated block ids, or None, changing nothing, when the pool cannot supply them.
        `computed_blocks` (from `get_computed_blocks`) are only accepted on a request's first allocation, where they
        head its block table. Afterwards the blocks made full by tokens computed once this step runs are cached.
        """
        blocks = self._blocks.get(request.request_id)
        assert not computed_blocks or blocks is None, "computed blocks are only taken on a request's first allocation"
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        held = len(blocks) if blocks is not None else len(computed_blocks)
        if blocks is not None and self.has_room(request, num_new_tokens):
            return []  # the common decode step: room in the last block, no block newly full
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - held)
        if num_new_blocks and num_new_blocks > self._num_allocatable(computed_blocks):
            return None
        if blocks is None:
            blocks = self._start(request, computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks) if num_new_blocks else []  # [] when only caching
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_tokens)
        self._room[request.request_id] = self._tokens_in_place(request.request_id)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finish, abort, preemption); its cached full blocks stay findable
        until evicted. A request holding no blocks is fine (an abort before scheduling)."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._room.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. after a weight update); False while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def waste(self, requests: Iterable[Request]) -> tuple[int, int]:
        """Internal fragmentation of these requests: (allocated slots, slots not holding a known token).

        A slot counts as filled once its token is known (prompt or sampled), whether or not its K/V has been
        written yet: what is measured is space the block size wastes, not the schedule's progress.
        """
        allocated = unfilled = 0
        for request in requests:
            slots = len(self._blocks.get(request.request_id, ())) * self.block_size
            allocated += slots
            unfilled += slots - min(slots, request.num_tokens)
        return allocated, unfilled

    def check_invariants(self) -> None:
        """Assert the pool is consistent and each block's reference count equals the block tables holding it."""
        self.block_pool.check_invariants()
        holders = [0] * self.num_blocks
        for blocks in self._blocks.values():
            for block in blocks:
                holders[block] += 1
        for block, count in enumerate(holders):
            assert self.block_pool.ref_count(block) == count, f"block {block}: ref count vs {count} holders"

    def _tokens_in_place(self, request_id: str) -> int:
        """How many tokens fit the request's blocks before one more must be allocated or a block becomes full
        (and must be offered to the hash map): the bound of allocate_slots' no-op case."""
        limit = len(self._blocks[request_id]) * self.block_size
        if self.enable_prefix_caching:
            limit = min(limit, (self._num_cached_blocks[request_id] + 1) * self.block_size - 1)
        return limit

    def _num_allocatable(self, computed_blocks: Sequence[int]) -> int:
        """Free blocks left once the prefix hit is taken: a hit on an evictable block removes it from the free
        queue, so it cannot also be handed out as a new block."""
        if not computed_blocks:  # a running request growing: no hit to take
            return self.block_pool.num_free_blocks
        evictable_hits = sum(self.block_pool.ref_count(block) == 0 for block in computed_blocks)
        return self.block_pool.num_free_blocks - evictable_hits

    def _start(self, request: Request, computed_blocks: Sequence[int]) -> list[int]:
        """First allocation of a scheduling: take the hit's references and count the lookup in the stats."""
        self.block_pool.touch(computed_blocks)
        blocks = list(computed_blocks)
        self._blocks[request.request_id] = blocks
        self._num_cached_blocks[request.request_id] = len(blocks)
        if self.enable_prefix_caching:
            self._stats = self._stats.record(request.num_tokens, len(blocks) * self.block_size)
        return blocks

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        """Offer the hash map every block full of tokens computed by the end of this step, and no other.

        A full block whose tokens are known but not yet computed (a chunked prefill's later blocks) must wait: a
        request hitting it now would read K/V that was never written.
        """
        if not self.enable_prefix_caching:
            return
        update_block_hashes(request, self.block_size)
        num_cached = self._num_cached_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for index in range(num_cached, num_full):
            self.block_pool.cache_block(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = max(num_cached, num_full)
