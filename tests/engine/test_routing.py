"""The data-parallel routing rule on fake loads: cache affinity within a load bound, ties to the least loaded."""

from __future__ import annotations

import collections
import types
from typing import Any

import pytest

from jengine.engine.replicated_core import ReplicatedCore
from jengine.engine.routing import Candidate, ReplicaAffinity, affinity_slack, rank
from jengine.errors import CapacityError


def test_equal_runs_tie_and_go_to_the_least_loaded_then_the_one_chosen_longest_ago() -> None:
    assert rank([Candidate(2, 3), Candidate(2, 1), Candidate(2, 2)]) == [1, 2, 0]
    assert rank([Candidate(0, 1, last_chosen=5), Candidate(0, 1, last_chosen=2)]) == [1, 0]


def test_the_longest_run_keeps_its_affinity_within_the_bound_only() -> None:
    assert rank([Candidate(3, 4), Candidate(1, 0)]) == [0, 1]  # 4 more than the least loaded: still within
    assert rank([Candidate(3, 5), Candidate(1, 0)]) == [1, 0]  # 5 more: the least loaded one takes it
    assert rank([Candidate(3, 25), Candidate(0, 20)]) == [0, 1]  # above 16, the bound is 25 % of the least load
    assert rank([Candidate(3, 26), Candidate(0, 20)]) == [1, 0]
    assert [affinity_slack(load) for load in (0, 4, 16, 20, 100)] == [4, 4, 4, 5, 25]


def test_beyond_the_bound_the_best_run_within_it_wins_and_the_rest_follow_by_load() -> None:
    candidates = [Candidate(5, 12), Candidate(0, 2), Candidate(3, 6), Candidate(9, 9)]
    # least load 2, bound 6: within it replica 2 (run 3) before replica 1 (run 0); then 3 and 0 by load
    assert rank(candidates) == [2, 1, 3, 0]


def test_unhealthy_replicas_are_never_ranked() -> None:
    assert rank([Candidate(4, 0, available=False), Candidate(0, 7)]) == [1]
    # the bound is measured from the least loaded healthy replica, not from a dead idle one
    assert rank([Candidate(0, 0, available=False), Candidate(2, 7), Candidate(0, 3)]) == [1, 2]
    assert rank([Candidate(1, 0, available=False)]) == [] and rank([]) == []


def _serve(prompts: list[list[bytes]], in_flight: int, replicas: int = 2) -> list[int]:
    """Route `prompts` (block hashes) with `in_flight` requests at a time, the oldest finishing first; the replica of
    each request."""
    affinity = ReplicaAffinity([1024] * replicas)
    loads, running, owners = [0] * replicas, collections.deque[int](), []
    for hashes in prompts:
        if len(running) == in_flight:
            loads[running.popleft()] -= 1
        replica = affinity.rank(hashes, loads)[0]
        affinity.chose(replica, hashes)
        loads[replica] += 1
        running.append(replica)
        owners.append(replica)
    return owners


@pytest.mark.parametrize("in_flight", [8, 16, 64])
def test_a_shared_chat_header_does_not_pull_every_request_onto_one_replica(in_flight: int) -> None:
    header = [b"header-0", b"header-1"]  # the template's header and a short system line: two full blocks
    owners = _serve([header + [f"question-{i}".encode()] for i in range(200)], in_flight)
    shares = [owners.count(r) / len(owners) for r in (0, 1)]
    assert min(shares) >= 0.35, shares


def test_a_long_shared_prompt_stays_where_it_is_cached_within_the_bound() -> None:
    system_a, system_b = [f"a{k}".encode() for k in range(64)], [f"b{k}".encode() for k in range(64)]
    prompts = [(system_a if i % 2 == 0 else system_b) + [f"q{i}".encode()] for i in range(40)]
    owners = _serve(prompts, in_flight=8)
    assert len(set(owners[0::2])) == 1 and len(set(owners[1::2])) == 1 and owners[0] != owners[1]


def test_affinity_remembers_what_it_sent() -> None:
    affinity = ReplicaAffinity([8, 8])
    assert affinity.rank([b"x", b"y"], [0, 0]) == [0, 1]
    affinity.chose(0, [b"x", b"y"])
    assert affinity.indexes[0].match([b"x", b"y", b"z"]) == 2 and len(affinity.indexes[1]) == 0
    assert affinity.rank([b"x", b"y"], [3, 0]) == [0, 1]  # its run, within the bound
    assert affinity.rank([b"other"], [0, 0]) == [1, 0]  # a tie: the one chosen longest ago
    assert affinity.rank([b"x"], [0, 0], available=[False, True]) == [1]


class _FullAfter:
    """A core that holds at most `capacity` requests (what ReplicatedCore reads of an EngineCore)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.added: list[str] = []
        self.kv_manager = types.SimpleNamespace(num_blocks=64)

    def num_requests(self) -> int:
        return len(self.added)

    def add_request(self, request: Any, *, enforce_queue_bound: bool = True) -> None:
        if enforce_queue_bound and len(self.added) >= self.capacity:
            raise CapacityError("full")
        self.added.append(request.request_id)


def test_the_replicated_core_hands_a_request_to_the_next_replica_when_full() -> None:
    cores = [_FullAfter(1), _FullAfter(2)]
    replicated = ReplicatedCore(cores, block_size=4)  # type: ignore[arg-type]

    def add(request_id: str) -> None:
        replicated.add_request(types.SimpleNamespace(request_id=request_id, all_token_ids=list(range(9)),
                                                     cache_salt=None))  # type: ignore[arg-type]

    for request_id in ("a", "b", "c"):  # one prompt: its replica first, the other once that one is full
        add(request_id)
    assert (cores[0].added, cores[1].added) == (["a"], ["b", "c"])
    with pytest.raises(CapacityError):
        add("d")
