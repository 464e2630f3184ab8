"""The scheduler's table of device slots: which adapter each of the `max_loras` slots holds, and how many admitted
requests use it. Integers and names only (no jax): the runner owns the slot arrays and loads what the plan says.

A request is admitted only when its adapter holds a slot, so a step never runs more than `max_loras` distinct
adapters. A slot whose requests have all left keeps its adapter (a later request reuses it without loading); when
a new adapter needs a slot, the empty ones go first, then the least recently released.
"""

from __future__ import annotations

import collections


class LoraSlotTable:
    def __init__(self, num_slots: int) -> None:
        self.names: list[str | None] = [None] * num_slots
        self.users = [0] * num_slots  # running requests per slot (a preempted one gives its slot back)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(num_slots))

    def slot_of(self, name: str) -> int | None:
        try:
            return self.names.index(name)
        except ValueError:
            return None

    def can_acquire(self, name: str) -> bool:
        return name in self.names or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, bool]:
        """The slot for `name` with one more user, and whether its weights must be loaded first (call
        `can_acquire` before)."""
        slot = self.slot_of(name)
        load = slot is None
        if load:
            empty = [s for s in self._idle if self.names[s] is None]
            slot = empty[0] if empty else next(iter(self._idle))
            self.names[slot] = name
        self.users[slot] += 1
        self._idle.pop(slot, None)
        return slot, load

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None

    def forget(self, name: str) -> None:
        """An unloaded adapter leaves its slot (only while no request uses it)."""
        slot = self.slot_of(name)
        if slot is not None and self.users[slot] == 0:
            self.names[slot] = None

    def in_use(self, name: str) -> int:
        slot = self.slot_of(name)
        return 0 if slot is None else self.users[slot]

    def active(self) -> list[str]:
        return [n for n, users in zip(self.names, self.users) if n is not None and users]
