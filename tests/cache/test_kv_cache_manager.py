"""KVCacheManager with fake requests (no model): prefix sharing, the hit cap, LRU reuse, all-or-nothing allocation,
salts, caching only computed blocks, waste, stats; hashing; and a hypothesis state machine over a mini scheduler."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jengine.cache import KVCacheManager, hash_block, hash_blocks
from jengine.request import Request

BLOCK_SIZE = 4


def _request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(tokens), sampling_params=None, cache_salt=cache_salt)  # type: ignore[arg-type]


def _schedule(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> list[int] | None:
    """One step of a fake scheduler: prefix lookup on first scheduling, allocate, advance the computed tokens."""
    hit: list[int] = []
    num_hit = 0
    if not manager.block_ids(request.request_id):
        hit, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit
    new_blocks = manager.allocate_slots(request, num_new_tokens, hit)
    if new_blocks is not None:
        request.num_computed_tokens += num_hit + num_new_tokens
    return new_blocks


# --- hashing ---------------------------------------------------------------------------------------------------------

def test_hashes_are_a_chain_over_full_blocks_only() -> None:
    first = hash_block(None, [0, 1, 2, 3])
    assert hash_blocks(list(range(10)), BLOCK_SIZE) == [first, hash_block(first, [4, 5, 6, 7])]
    assert hash_block(None, [4, 5, 6, 7]) != hash_blocks(list(range(10)), BLOCK_SIZE)[1]  # the parent matters
    assert len(first) == 32


def test_hash_blocks_continues_a_known_chain() -> None:
    known = hash_blocks(list(range(6)), BLOCK_SIZE)
    assert len(known) == 1
    assert hash_blocks(list(range(7)), BLOCK_SIZE, known=known) == []  # no block newly full
    whole = hash_blocks(list(range(9)), BLOCK_SIZE)
    assert known + hash_blocks(list(range(9)), BLOCK_SIZE, known=known) == whole and len(whole) == 2


def test_salt_changes_every_hash() -> None:
    plain = hash_blocks(list(range(8)), BLOCK_SIZE)
    salted = hash_blocks(list(range(8)), BLOCK_SIZE, cache_salt="tenant")
    assert not set(plain) & set(salted)


def test_the_manager_hashes_a_requests_tokens_as_they_grow() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    request = _request("a", [1, 2, 3], cache_salt="s")
    _schedule(manager, request)
    request.append_output([4, 5])
    _schedule(manager, request)
    assert request.block_hashes == hash_blocks([1, 2, 3, 4, 5], BLOCK_SIZE, cache_salt="s")


def test_importing_jengine_cache_does_not_import_jax() -> None:
    code = "import sys, jengine.cache; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- manager ---------------------------------------------------------------------------------------------------------

def test_two_requests_with_a_common_prefix_share_physical_blocks() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    a = _request("a", list(range(10)))
    assert _schedule(manager, a) == [0, 1, 2]
    b = _request("b", list(range(8)) + [50, 51, 52])
    assert manager.get_computed_blocks(b) == ([0, 1], 8)
    assert _schedule(manager, b) == [3]
    assert manager.block_ids("b") == [0, 1, 3]
    assert [manager.block_pool.ref_count(block) for block in (0, 1, 2, 3)] == [2, 2, 1, 1]
    manager.check_invariants()


def test_a_fully_cached_prompt_leaves_at_least_one_token_to_compute() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    _schedule(manager, _request("a", list(range(9))))
    assert manager.get_computed_blocks(_request("aligned", list(range(8)))) == ([0], 4)  # whole last block redone
    assert manager.get_computed_blocks(_request("same", list(range(9)))) == ([0, 1], 8)  # one token left
    single = _request("single", list(range(4)))
    assert manager.get_computed_blocks(single) == ([], 0)


def test_cache_outlives_free_and_is_reused_later() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = _request("a", list(range(12)))
    _schedule(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    b = _request("b", list(range(12)) + [99])
    assert _schedule(manager, b) == [3]
    assert manager.block_ids("b") == [0, 1, 2, 3]
    assert manager.usage == 0.5
    manager.check_invariants()


def test_eviction_takes_the_least_recently_freed_and_a_sequence_tail_first() -> None:
    manager = KVCacheManager(6, BLOCK_SIZE)
    old, recent = _request("old", list(range(8))), _request("recent", list(range(100, 108)))
    _schedule(manager, old)  # blocks 0, 1
    _schedule(manager, recent)  # blocks 2, 3
    manager.free(old)
    manager.free(recent)
    filler = _request("filler", list(range(200, 212)))  # 3 blocks: the 2 never used, then old's tail
    assert _schedule(manager, filler) == [4, 5, 1]
    probe_old = _request("probe_old", list(range(8)) + [7])
    assert manager.get_computed_blocks(probe_old) == ([0], 4)  # head survived its tail
    assert manager.get_computed_blocks(_request("probe_recent", list(range(100, 108)) + [7])) == ([2, 3], 8)
    manager.check_invariants()


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)
    _schedule(manager, _request("a", list(range(100, 112))))  # 3 of 4 blocks
    b = _request("b", list(range(8)))
    assert _schedule(manager, b) is None
    assert manager.block_ids("b") == [] and manager.num_free_blocks == 1 and b.num_computed_tokens == 0
    assert manager.prefix_cache_stats.requests == 1
    manager.check_invariants()


def test_evictable_hit_blocks_are_not_counted_twice() -> None:
    manager = KVCacheManager(3, BLOCK_SIZE)
    a = _request("a", list(range(8)))
    _schedule(manager, a)
    manager.free(a)
    b = _request("b", list(range(8)) + list(range(50, 58)))  # hits 2 evictable blocks, needs 2 more, 1 left
    hit, num_hit = manager.get_computed_blocks(b)
    assert (hit, num_hit) == ([0, 1], 8)
    assert manager.allocate_slots(b, 8, hit) is None
    assert [manager.block_pool.ref_count(block) for block in hit] == [0, 0]
    assert manager.get_computed_blocks(b) == ([0, 1], 8)  # still cached
    assert manager.allocate_slots(b, 4, hit) == [2]  # a smaller chunk fits
    manager.check_invariants()


def test_cache_salt_isolates_sharing() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    _schedule(manager, _request("a", list(range(9)), cache_salt="tenant-1"))
    assert manager.get_computed_blocks(_request("b", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(_request("c", list(range(9)), cache_salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(_request("d", list(range(9)), cache_salt="tenant-1"))[1] == 8


def test_a_block_is_cached_only_once_its_tokens_are_computed() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    a = _request("a", list(range(13)))
    assert _schedule(manager, a, 5) == [0, 1]  # block 1 is allocated, but holds only one computed token
    probe = _request("probe", list(range(13)))
    assert manager.get_computed_blocks(probe) == ([0], 4)
    _schedule(manager, a, 8)
    assert manager.get_computed_blocks(probe) == ([0, 1, 2], 12)


def test_a_block_completed_by_a_generated_token_is_cached_when_that_token_is_computed() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    a = _request("a", [1, 2, 3])
    _schedule(manager, a)
    a.append_output([4])  # sampled: known, K/V not written yet
    probe = _request("probe", [1, 2, 3, 4, 5])
    assert manager.get_computed_blocks(probe) == ([], 0)
    _schedule(manager, a)  # the decode step computes token 4
    assert manager.get_computed_blocks(probe) == ([0], 4)


def test_waste_counts_allocated_slots_without_a_token() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    a, b, waiting = _request("a", list(range(5))), _request("b", list(range(10, 18))), _request("w", [1])
    _schedule(manager, a)
    _schedule(manager, b)
    assert manager.waste([a, b, waiting]) == (16, 3)
    a.append_output([9, 9])
    assert manager.waste([a]) == (8, 1)


def test_prefix_cache_stats_count_once_per_scheduling() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    a = _request("a", list(range(10)))
    _schedule(manager, a)
    b = _request("b", list(range(10)))
    manager.get_computed_blocks(b)  # a lookup alone (e.g. before a failed allocation) is not counted
    _schedule(manager, b)
    a.append_output([3])
    _schedule(manager, a)  # a decode is not a new query
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == 0.4
    manager.free(b)  # preempted, then resumed: it queries the cache again
    b.num_computed_tokens = 0
    _schedule(manager, b)
    assert manager.prefix_cache_stats.requests == 3 and manager.prefix_cache_stats.hits == 16


def test_disabled_prefix_caching_never_hits_or_counts() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    _schedule(manager, a)
    manager.free(a)
    b = _request("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert manager.prefix_cache_stats.queries == 0 and manager.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = _request("a", list(range(9)))
    _schedule(manager, a)
    assert not manager.reset_prefix_cache()
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)


def test_free_of_a_request_without_blocks_is_a_no_op() -> None:
    manager = KVCacheManager(2, BLOCK_SIZE)
    manager.free(_request("never-scheduled", [1, 2]))
    assert manager.num_free_blocks == 2


# --- state machine ---------------------------------------------------------------------------------------------------

SHARED_PREFIXES = [[], [0] * 8, [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]]  # like system prompts: most arrivals share one


class CacheMachine(RuleBasedStateMachine):
    """A mini scheduler over the manager, with a fake runner writing each computed token into its slot.

    Besides the bookkeeping invariants, every prefix hit is checked against what the fake runner wrote: a hit
    block must hold exactly the request's tokens (and salt), which catches caching a block before it is computed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(12, BLOCK_SIZE)
        self.requests: dict[str, Request] = {}
        self.slots: dict[int, list[tuple[str | None, int] | None]] = {}  # block -> what the runner wrote there
        self.next_id = 0

    @rule(prefix=st.sampled_from(SHARED_PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=10),
          salt=st.sampled_from([None, None, "s"]))
    def arrive(self, prefix: list[int], suffix: list[int], salt: str | None) -> None:
        request = _request(f"r{self.next_id}", prefix + suffix or [0], cache_salt=salt)
        self.next_id += 1
        self.requests[request.request_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def step(self, data: st.DataObject, chunk: int) -> None:
        request = data.draw(st.sampled_from(sorted(self.requests.values(), key=lambda r: r.request_id)))
        first = not self.manager.block_ids(request.request_id)
        hit, num_hit = self.manager.get_computed_blocks(request) if first else ([], 0)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens - num_hit)
        if num_new <= 0:  # every known token computed: sample the next one instead
            request.append_output([data.draw(st.integers(0, 2))])
            return
        self._check_hit(request, hit)
        before = (self.manager.num_free_blocks, self.manager.block_ids(request.request_id))
        new_blocks = self.manager.allocate_slots(request, num_new, hit)
        if new_blocks is None:
            assert (self.manager.num_free_blocks, self.manager.block_ids(request.request_id)) == before
            return
        for block in new_blocks:
            self.slots[block] = [None] * BLOCK_SIZE
        self._write(request, request.num_computed_tokens + num_hit, num_new)
        request.num_computed_tokens += num_hit + num_new

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        """Finish, abort or preempt a request (all free its blocks; a preempted one comes back to recompute)."""
        request = data.draw(st.sampled_from(sorted(self.requests.values(), key=lambda r: r.request_id)))
        self.manager.free(request)
        if preempt:
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        else:
            del self.requests[request.request_id]

    def _check_hit(self, request: Request, hit: list[int]) -> None:
        for index, block in enumerate(hit):
            tokens = request.all_token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
            assert self.slots[block] == [(request.cache_salt, token) for token in tokens], "hit on wrong K/V"

    def _write(self, request: Request, start: int, count: int) -> None:
        blocks = self.manager.block_ids(request.request_id)
        for position in range(start, start + count):
            self.slots[blocks[position // BLOCK_SIZE]][position % BLOCK_SIZE] = (
                request.cache_salt, request.all_token_ids[position])

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()  # includes: ref count == number of block tables holding the block
        used = sum(self.manager.block_pool.ref_count(block) > 0 for block in range(self.manager.num_blocks))
        assert self.manager.num_free_blocks + used == self.manager.num_blocks
        for request in self.requests.values():
            assert len(self.manager.block_ids(request.request_id)) * BLOCK_SIZE >= request.num_computed_tokens

    def teardown(self) -> None:
        for request in list(self.requests.values()):
            self.manager.free(request)
        self.manager.check_invariants()
        assert all(self.manager.block_pool.ref_count(block) == 0 for block in range(self.manager.num_blocks))
        assert self.manager.num_free_blocks == self.manager.num_blocks


CacheMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
