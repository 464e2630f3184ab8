"""`ReplicatedCore`: `EngineCore`'s interface over data-parallel replicas, for the notebook API (`LLM`).

`LLM(..., data_parallel_size=N)` builds N engine cores on disjoint device groups and steps them all from one thread:
each core's step only dispatches device work and fetches the step before it, so the replicas' devices compute side
by side. A request goes where the serving router would send it (`jengine.engine.routing`: the replica already sent
its prompt's leading blocks, the KV manager's own block hashes, while its load stays within the bound; otherwise the
one holding the fewest requests), without the router's threads; a full replica hands it to the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from jengine.cache.hashing import hash_blocks
from jengine.engine.core import EngineCore, EngineCoreOutput
from jengine.engine.routing import ReplicaAffinity
from jengine.errors import CapacityError
from jengine.request import Request, RequestStatus


class ReplicatedCore:
    """Single-threaded like `EngineCore`; the caller owns it exclusively."""

    def __init__(self, cores: Sequence[EngineCore], block_size: int) -> None:
        self.cores = list(cores)
        self.block_size = block_size
        self._affinity = ReplicaAffinity([core.kv_manager.num_blocks for core in self.cores])
        self._owner: dict[str, int] = {}  # request id → replica, until the request finishes

    def add_request(self, request: Request, *, enforce_queue_bound: bool = True) -> None:
        hashes = hash_blocks(request.all_token_ids, self.block_size, cache_salt=request.cache_salt)
        refusals: list[CapacityError] = []
        for replica in self._affinity.rank(hashes, [core.num_requests() for core in self.cores]):
            try:
                self.cores[replica].add_request(request, enforce_queue_bound=enforce_queue_bound)
            except CapacityError as exc:  # full: the next best replica may take it
                refusals.append(exc)
                continue
            self._affinity.chose(replica, hashes)
            self._owner[request.request_id] = replica
            return
        raise refusals[0]

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
              ) -> list[EngineCoreOutput]:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._owner:
                by_replica.setdefault(self._owner.pop(request_id), []).append(request_id)
        return [out for replica, ids in by_replica.items() for out in self.cores[replica].abort(ids, status)]

    def step(self) -> list[EngineCoreOutput]:
        outputs = [out for core in self.cores for out in core.step()]  # an idle core's step is cheap
        for out in outputs:
            if out.finish_reason is not None:
                self._owner.pop(out.request_id, None)
        return outputs

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def num_requests(self) -> int:
        return sum(core.num_requests() for core in self.cores)

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.cores])  # every replica, even after a refusal

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
