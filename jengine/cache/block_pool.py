"""The pool of KV-cache blocks as integers: reference counts, a free queue in eviction order, and hash → block.

The runner owns the device arrays; this object only decides which block ids hold what. A block is *free* when its
reference count is 0, even if it still holds a cached hash: such a block is kept for prefix reuse until an
allocation needs it (then it is evicted), so cached blocks never make the engine run out of room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Reference-counted blocks with an LRU free queue and a prefix-cache map (host integers only).

    The free queue is an `OrderedDict` used as an O(1) doubly-linked list: allocation pops the head, a freed
    cached block joins the tail, and a prefix hit on a free block unlinks it from the middle. A freed block that
    holds no hash has nothing worth keeping, so it joins the head and is reused before any cached block is
    evicted. Each hash maps to one block and each block holds at most one hash.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0, cached (evictable) ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (0..1); cached free blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by `lookup` (held or evictable)."""
        return len(self._hash_to_block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._block_hashes[block]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue (evicting their hashes) with ref count 1.

        Raises ValueError when there are not enough: callers check `num_free_blocks` first, so this is a bug.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            self._ref_counts[block] = 1
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix hit), unlinking free ones from the free queue."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in reverse order: a sequence's tail is evicted before its head.

        The tail is the least likely to be shared (longer prefixes are rarer), and evicting the head first would
        strand the tail anyway, since a hit needs the whole chain before it.
        """
        for block in reversed(list(blocks)):
            count = self._ref_counts[block]
            assert count > 0, f"block {block} freed with reference count {count}"
            self._ref_counts[block] = count - 1
            if count == 1:
                self._release(block)

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Make a held, full block findable by `block_hash`; returns whether it now is this block's hash.

        When another block already holds the same hash (two requests computed the same prefix at once), the first
        one stays the cached copy and this block stays unhashed: block ids never change under a request.
        """
        if not self.enable_prefix_caching:
            return False
        assert self._ref_counts[block] > 0, f"caching block {block}, which no request holds"
        current = self._block_hashes[block]
        if current is not None:
            assert current == block_hash, f"block {block} is already cached under another hash"
            return True
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block
        self._block_hashes[block] = block_hash
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching `block_hash`, held or evictable, or None."""
        return self._hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update); refused (False) while any block is held.

        Held blocks may be re-cached by their requests as they grow, so clearing the map under them would not
        make the cache stale-free; the caller retries once the running requests have drained.
        """
        if len(self._free) != self.num_blocks:
            return False
        self._hash_to_block.clear()
        self._block_hashes = [None] * self.num_blocks
        return True

    def check_invariants(self) -> None:
        """Assert the pool is consistent (for tests): free queue = ref-0 blocks, hash map ↔ block hashes."""
        assert all(count >= 0 for count in self._ref_counts), "negative reference count"
        free = {block for block, count in enumerate(self._ref_counts) if count == 0}
        assert set(self._free) == free, "free queue differs from the set of blocks with reference count 0"
        assert len(self._free) == len(free)
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hashes[block] == block_hash, f"hash map points at block {block} holding another hash"
        hashed = sum(block_hash is not None for block_hash in self._block_hashes)
        assert hashed == len(self._hash_to_block), "a block holds a hash the map does not know"

    def _evict(self, block: int) -> None:
        """Drop a block's cached hash when it is reused for other content."""
        block_hash = self._block_hashes[block]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hashes[block] = None

    def _release(self, block: int) -> None:
        """Put a block that just reached reference count 0 into the free queue (see the class docstring)."""
        self._free[block] = None
        if self._block_hashes[block] is None:
            self._free.move_to_end(block, last=False)
