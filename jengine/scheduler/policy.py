"""Queue order: lower `priority` first, then arrival (FCFS). A preempted request keeps its place in that order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from jengine.request import Request


class WaitingQueue:
    """A priority queue of requests with O(log n) push/pop and O(n) removal (aborts are rare)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._order: dict[str, int] = {}
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        order = self._order.setdefault(request.request_id, next(self._counter))
        heapq.heappush(self._heap, (request.priority, order, request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> bool:
        for i, (_, _, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def forget(self, request_id: str) -> None:
        """Drops the arrival order of a request that has left the engine."""
        self._order.pop(request_id, None)

    def sort_key(self, request: Request) -> tuple[int, int]:
        return request.priority, self._order.setdefault(request.request_id, next(self._counter))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in self._heap)
