"""`Router`: one `EngineClient` over N engine replicas serving the same model (data parallelism).

Each request goes where `jengine.engine.routing` ranks it (the rule `LLM(data_parallel_size=N)` follows too): to the
replica already holding the longest leading run of its prompt's KV blocks while that replica's load stays within a
bound of the least loaded one's, otherwise (and on ties) to the least loaded one; so a shared system prompt is
prefilled once per replica rather than once per request, and a chat template's shared header does not pull every
chat onto one replica. The blocks are named by the KV manager's own sha256 chain (`hash_blocks` over the ids
the engine will see: the front's tokenizer, chats rendered by the input processor), and the router remembers what it
sent each replica in a bounded LRU index: its approximate view of that replica's prefix cache.

Load is the replica's running + waiting requests from its published stats, or the requests the router has in flight
on it where that is more (the stats lag a step behind, and a burst of requests arrives within one step). Health and
stats are read by a poller thread, because a remote replica answers them with a network round trip that must not
block the event loop; the routing path reads only those snapshots and its own counters. A replica that refuses a
request before its first output (full, draining, dead) is skipped and the next best one is tried.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from jengine.cache.hashing import hash_blocks
from jengine.cache.prefix_index import PrefixIndex
from jengine.clients.protocol import EngineClient, ModelInfo, request_identity
from jengine.engine.routing import ReplicaAffinity
from jengine.engine.stats import EngineStats
from jengine.front.input_processor import InputProcessor, PromptInput
from jengine.errors import CapacityError, ConfigError, EngineDeadError, ServiceUnavailableError
from jengine.outputs import RequestOutput
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jengine.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_INDEX_BLOCKS = 1 << 16  # index bound when a replica does not report its KV pool size
POLL_INTERVAL_S = 0.05


@dataclasses.dataclass(eq=False)
class _Replica:
    """One replica and what the router knows of it: snapshots written by the poller, counters by the event loop."""

    position: int
    client: EngineClient
    processor: InputProcessor  # the replica's tokenizer with the input processor's prompt handling
    stats: EngineStats
    healthy: bool = True
    in_flight: int = 0  # core requests (choices) the router sent and has not seen end

    @property
    def load(self) -> int:
        return max(self.stats.num_running + self.stats.num_waiting, self.in_flight)

    def refresh(self) -> None:
        """Poll health, then stats (a replica that does not answer is unhealthy until it does)."""
        try:
            healthy = self.client.is_healthy()
            if healthy:
                self.stats = self.client.stats()
        except Exception:  # noqa: BLE001 - any failure to answer means "do not route here now"
            logger.debug("replica %d did not answer", self.position, exc_info=True)
            healthy = False
        if healthy != self.healthy:
            logger.warning("engine replica %d is %s", self.position, "healthy again" if healthy else "unhealthy")
        self.healthy = healthy


class Router:
    """`EngineClient` over replicas of one model; owns them (shutting the router down shuts them down)."""

    def __init__(self, replicas: Sequence[EngineClient], *, block_size: int | None = None,
                 index_blocks: int | None = None, poll_interval_s: float = POLL_INTERVAL_S) -> None:
        """`block_size` defaults to the one the replicas report; `index_blocks` (the LRU bound per replica) to each
        replica's KV pool size. Raises ConfigError when the replicas serve different models or block sizes."""
        if not replicas:
            raise ConfigError("a router needs at least one engine replica")
        self._model_info = _agreed_model_info(replicas)
        stats = [client.stats() for client in replicas]
        self.block_size = _agreed_block_size(stats, block_size)
        self._replicas = [_Replica(i, client, _prompt_processor(client, self._model_info), s)
                          for i, (client, s) in enumerate(zip(replicas, stats, strict=True))]
        self._affinity = ReplicaAffinity([index_blocks or s.num_gpu_blocks or DEFAULT_INDEX_BLOCKS for s in stats])
        self._owners: dict[str, _Replica] = {}
        self.refresh()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(poll_interval_s,), name="jengine-router", daemon=True)
        self._poller.start()
        logger.info("routing over %d engine replicas (prefix-aware, block size %d)", len(replicas), self.block_size)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Router:
        """`data_parallel_size` in-process replicas, replica i on devices [i*tp, (i+1)*tp), each an `AsyncEngine`
        with its own core thread. Refused before any weight is loaded when the devices do not suffice."""
        from jengine.clients.async_engine import AsyncEngine  # imports jax: only when engines are really built
        from jengine.factory import build_engine
        from jengine.parallel.mesh import replica_devices
        from jengine.runner.device_pool import size_pool

        parallel = config.parallel
        size_pool(config.cache.gpu_memory_utilization)  # before replica_devices starts JAX's backends
        groups = [replica_devices(parallel.tensor_parallel_size, parallel.data_parallel_size, i)
                  for i in range(parallel.data_parallel_size)]
        engines: list[AsyncEngine] = []
        try:
            for i, devices in enumerate(groups):
                logger.info("building engine replica %d of %d on %s", i + 1, len(groups), devices)
                engines.append(AsyncEngine(build_engine(config, devices)))
            return cls(engines)
        except BaseException:
            for engine in engines:
                engine.shutdown()
            raise

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Tokenize, route, and stream the chosen replica's outputs; leaving early aborts it there."""
        params, request_id = request_identity(sampling_params, request_id, self._owners)
        forward, hashes = self._prepare(prompt)
        replica, stream, first = await self._open(forward, params, request_id, priority, hashes)
        try:
            yield first
            if not first.finished:
                async for output in stream:
                    yield output
        finally:
            await stream.aclose()  # a no-op once finished; otherwise the replica aborts the request
            self._release(request_id, replica, params)

    async def abort(self, request_id: str) -> None:
        """Abort on the replica that holds the request; unknown ids are ignored."""
        replica = self._owners.get(request_id)
        if replica is not None:
            await replica.client.abort(request_id)

    def get_tokenizer(self) -> Tokenizer:
        """The front's tokenizer: the first healthy replica's (they serve one model)."""
        return self._front().processor.tokenizer

    def get_model_info(self) -> ModelInfo:
        return self._model_info

    def is_healthy(self) -> bool:
        """True while at least one replica is."""
        return any(replica.healthy for replica in self._replicas)

    def stats(self) -> EngineStats:
        """The replicas' latest snapshots summed (KV usage weighted by pool size)."""
        return sum_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's latest snapshot, in replica order."""
        return [replica.stats for replica in self._replicas]

    def shutdown(self) -> None:
        """Stop polling and shut every replica down (one failing does not stop the others)."""
        self._stop.set()
        if self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        for replica in self._replicas:
            try:
                replica.client.shutdown()
            except Exception:  # noqa: BLE001 - the others must still stop
                logger.exception("shutting down engine replica %d failed", replica.position)

    # ------------------------------------------------------------------ introspection
    def refresh(self) -> None:
        """Poll every replica's health and stats now (the poller thread does this every interval)."""
        for replica in self._replicas:
            replica.refresh()

    @property
    def replicas(self) -> list[EngineClient]:
        return [replica.client for replica in self._replicas]

    @property
    def prefix_indexes(self) -> list[PrefixIndex]:
        """The router's view of each replica's prefix cache, in replica order."""
        return list(self._affinity.indexes)

    def owner(self, request_id: str) -> int | None:
        """The position of the replica serving `request_id`, or None."""
        replica = self._owners.get(request_id)
        return None if replica is None else replica.position

    # ------------------------------------------------------------------ routing
    def _prepare(self, prompt: PromptInput) -> tuple[PromptInput, list[bytes]]:
        """(what to send: the ids with their text, so the replica does not tokenize again; the block hashes)."""
        text, ids = self._front().processor.tokenize(prompt)
        forward: PromptInput = ids if text is None else {"prompt": text, "prompt_token_ids": ids}
        return forward, hash_blocks(ids, self.block_size)  # the chain the KV manager computes for these tokens

    def _ranked(self, hashes: Sequence[bytes]) -> list[_Replica]:
        """Healthy replicas, best first, by the shared routing rule."""
        order = self._affinity.rank(hashes, [r.load for r in self._replicas], [r.healthy for r in self._replicas])
        if not order:
            raise EngineDeadError("no engine replica is healthy")
        return [self._replicas[position] for position in order]

    async def _open(self, prompt: PromptInput, params: SamplingParams, request_id: str, priority: int,
                    hashes: list[bytes]) -> tuple[_Replica, AsyncIterator[RequestOutput], RequestOutput]:
        """Submit to the best replica that takes the request; returns it with its stream and first output."""
        refusals: list[ServiceUnavailableError | CapacityError] = []
        for replica in self._ranked(hashes):
            stream = replica.client.generate(prompt, params, request_id, priority=priority)
            self._assign(request_id, replica, params, hashes)
            try:
                return replica, stream, await anext(stream)
            except (CapacityError, ServiceUnavailableError) as exc:  # refused before any output: try the next one
                refusals.append(exc)
                if isinstance(exc, ServiceUnavailableError):
                    replica.healthy = False  # until the poller hears otherwise
            except BaseException:
                await _close(stream)
                self._release(request_id, replica, params)
                raise
            await _close(stream)
            self._release(request_id, replica, params)
        capacity = [exc for exc in refusals if isinstance(exc, CapacityError)]
        raise (capacity or refusals)[0]

    def _assign(self, request_id: str, replica: _Replica, params: SamplingParams, hashes: list[bytes]) -> None:
        self._owners[request_id] = replica
        replica.in_flight += _num_choices(params)
        self._affinity.chose(replica.position, hashes)

    def _release(self, request_id: str, replica: _Replica, params: SamplingParams) -> None:
        if self._owners.get(request_id) is replica:
            del self._owners[request_id]
            replica.in_flight -= _num_choices(params)

    def _front(self) -> _Replica:
        return next((replica for replica in self._replicas if replica.healthy), self._replicas[0])

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.refresh()


def sum_stats(snapshots: Sequence[EngineStats]) -> EngineStats:
    """Counts and counters added; KV usage as the fraction of all replicas' blocks in use."""
    blocks = sum(s.num_gpu_blocks for s in snapshots)
    if blocks:
        usage = sum(s.kv_cache_usage * s.num_gpu_blocks for s in snapshots) / blocks
    else:
        usage = sum(s.kv_cache_usage for s in snapshots) / max(len(snapshots), 1)
    return EngineStats(
        num_running=sum(s.num_running for s in snapshots), num_waiting=sum(s.num_waiting for s in snapshots),
        kv_cache_usage=usage, num_preemptions=sum(s.num_preemptions for s in snapshots),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in snapshots),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in snapshots), num_gpu_blocks=blocks,
        block_size=max((s.block_size for s in snapshots), default=0),
        step_token_counts=tuple(map(sum, zip(*(s.step_token_counts for s in snapshots if s.step_token_counts)))),
        step_tokens_sum=sum(s.step_tokens_sum for s in snapshots),
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in snapshots),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in snapshots),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in snapshots),
        spec_decode_num_accepted_tokens_per_pos=tuple(
            map(sum, itertools.zip_longest(*(s.spec_decode_num_accepted_tokens_per_pos for s in snapshots),
                                           fillvalue=0))),
    )


def _agreed_model_info(replicas: Sequence[EngineClient]) -> ModelInfo:
    """The replicas' model, which they must agree on (the path may differ between hosts; the served name may not)."""
    infos = [client.get_model_info() for client in replicas]
    first = _comparable(infos[0])
    for position, info in enumerate(infos[1:], start=1):
        if _comparable(info) != first:
            raise ConfigError(
                f"engine replicas serve different models: replica 0 has {first}, replica {position} has "
                f"{_comparable(info)}; start them with the same model, --served-model-name and limits"
            )
    return infos[0]


def _comparable(info: ModelInfo) -> dict[str, object]:
    return {"name": info.name, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
            "max_logprobs": info.max_logprobs}


def _agreed_block_size(stats: Sequence[EngineStats], given: int | None) -> int:
    reported = sorted({s.block_size for s in stats if s.block_size})
    if len(reported) > 1 or (given is not None and reported and reported != [given]):
        raise ConfigError(f"engine replicas use different KV block sizes {reported}"
                          + (f" (the router was given {given})" if given is not None else ""))
    if given is None and not reported:
        raise ConfigError("the engine replicas do not report their KV block size; pass block_size to the router")
    return given if given is not None else reported[0]


def _prompt_processor(client: EngineClient, info: ModelInfo) -> InputProcessor:
    return InputProcessor(client.get_tokenizer(), info.vocab_size, info.max_model_len, info.max_logprobs)


def _num_choices(params: SamplingParams) -> int:
    return params.n if isinstance(params.n, int) and params.n >= 1 else 1


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    await stream.aclose()  # type: ignore[attr-defined]
