"""Per-request block lists over a `BlockPool`: prefix lookup, slot allocation, freeing (host integers only).

The scheduler asks two questions here: "how much of this request is already cached?" (`get_computed_blocks`) and
"can this request grow by N tokens?" (`allocate_slots`, which either allocates or changes nothing). The manager
reads a request's tokens and counters and keeps its `block_hashes` current (the one place that extends them); it
never moves `num_computed_tokens`, which stays the scheduler's to advance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jengine.cache.block_pool import BlockPool
from jengine.cache.hashing import hash_blocks
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


@dataclasses.dataclass(slots=True)
class _BlockTable:
    """One request's blocks and what the manager knows of them: the only per-request state it keeps."""

    block_ids: list[int]
    # Leading blocks already offered to the hash map: caching work is O(new full blocks).
    num_cached: int
    # Tokens the blocks hold with nothing to allocate and no block newly full (see `has_room`).
    room: int = -1


class KVCacheManager:
    """Owns each request's list of block ids; the pool below owns reference counts and the hash map."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, _BlockTable] = {}  # request id → its block table, while it holds blocks
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
        table = self._tables.get(request_id)
        return [] if table is None else list(table.block_ids)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached run of the request's leading full blocks, and the number of tokens it covers.

        Capped at `num_tokens - 1` tokens rounded down to whole blocks: the model must still run the last token to
        produce logits, so a fully cached prompt recomputes its last block. Takes no references: pass the blocks
        to `allocate_slots` in the same step, before anything else allocates. ([], 0) when caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` more fit the request's blocks with nothing to allocate and no block newly full:
        then `allocate_slots` would return [] and change nothing, so the scheduler skips it (the common decode)."""
        table = self._tables.get(request.request_id)
        return table is not None and request.num_computed_tokens + num_new_tokens <= table.room

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's blocks to cover its computed tokens, the prefix hit and `num_new_tokens` more.

        Returns the newly allocated block ids, or None, changing nothing, when the pool cannot supply them.
        `computed_blocks` (from `get_computed_blocks`) are only accepted on a request's first allocation, where they
        head its block table. Afterwards the blocks made full by tokens computed once this step runs are cached.
        """
        table = self._tables.get(request.request_id)
        assert not computed_blocks or table is None, "computed blocks are only taken on a request's first allocation"
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if table is not None and request.num_computed_tokens + num_new_tokens <= table.room:
            return []  # the common decode step: room in the last block, no block newly full
        held = len(table.block_ids) if table is not None else len(computed_blocks)
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - held)
        if num_new_blocks and num_new_blocks > self._num_allocatable(computed_blocks):
            return None
        if table is None:
            table = self._start(request, computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks) if num_new_blocks else []  # [] when only caching
        table.block_ids.extend(new_blocks)
        self._cache_full_blocks(request, table, num_tokens)
        table.room = self._tokens_in_place(table)
        return new_blocks

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Frees the request's blocks beyond those holding its first `num_tokens` tokens (rejected draft tokens
        rolled back); returns how many it keeps, or None when nothing was freed. Cached blocks are always kept."""
        table = self._tables.get(request.request_id)
        if table is None:
            return None
        keep = max(_cdiv(num_tokens, self.block_size), table.num_cached)
        if len(table.block_ids) <= keep:
            return None
        self.block_pool.free(table.block_ids[keep:])
        del table.block_ids[keep:]
        table.room = self._tokens_in_place(table)
        return keep

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finish, abort, preemption); its cached full blocks stay findable
        until evicted. A request holding no blocks is fine (an abort before scheduling)."""
        table = self._tables.pop(request.request_id, None)
        if table is not None and table.block_ids:
            self.block_pool.free(table.block_ids)

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
            table = self._tables.get(request.request_id)
            slots = 0 if table is None else len(table.block_ids) * self.block_size
            allocated += slots
            unfilled += slots - min(slots, request.num_tokens)
        return allocated, unfilled

    def check_invariants(self) -> None:
        """Assert the pool is consistent and each block's reference count equals the block tables holding it."""
        self.block_pool.check_invariants()
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table.block_ids:
                holders[block] += 1
        for block, count in enumerate(holders):
            assert self.block_pool.ref_count(block) == count, f"block {block}: ref count vs {count} holders"

    def _tokens_in_place(self, table: _BlockTable) -> int:
        """How many tokens fit the request's blocks before one more must be allocated or a block becomes full
        (and must be offered to the hash map): the bound of allocate_slots' no-op case."""
        limit = len(table.block_ids) * self.block_size
        if self.enable_prefix_caching:
            limit = min(limit, (table.num_cached + 1) * self.block_size - 1)
        return limit

    def _num_allocatable(self, computed_blocks: Sequence[int]) -> int:
        """Free blocks left once the prefix hit is taken: a hit on an evictable block removes it from the free
        queue, so it cannot also be handed out as a new block."""
        if not computed_blocks:  # a running request growing: no hit to take
            return self.block_pool.num_free_blocks
        evictable_hits = sum(self.block_pool.ref_count(block) == 0 for block in computed_blocks)
        return self.block_pool.num_free_blocks - evictable_hits

    def _start(self, request: Request, computed_blocks: Sequence[int]) -> _BlockTable:
        """First allocation of a scheduling: take the hit's references and count the lookup in the stats."""
        self.block_pool.touch(computed_blocks)
        table = self._tables[request.request_id] = _BlockTable(list(computed_blocks), len(computed_blocks))
        if self.enable_prefix_caching:
            self._stats = self._stats.record(request.num_tokens, len(computed_blocks) * self.block_size)
        return table

    def _cache_full_blocks(self, request: Request, table: _BlockTable, num_tokens: int) -> None:
        """Offer the hash map every block full of tokens computed by the end of this step, and no other.

        A full block whose tokens are known but not yet computed (a chunked prefill's later blocks) must wait: a
        request hitting it now would read K/V that was never written.
        """
        if not self.enable_prefix_caching:
            return
        hashes, blocks = self._block_hashes(request), table.block_ids
        num_full = min(num_tokens // self.block_size, len(hashes), len(blocks))
        for index in range(table.num_cached, num_full):
            self.block_pool.cache_block(blocks[index], hashes[index])
        table.num_cached = max(table.num_cached, num_full)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The request's block hashes, first extended over any block of its known tokens that became full."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        if len(tokens) >= (len(hashes) + 1) * self.block_size:
            hashes += hash_blocks(tokens, self.block_size, cache_salt=request.cache_salt, known=hashes,
                                  lora_name=request.lora_name)
        return hashes
