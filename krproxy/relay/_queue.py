"""Calls waiting for a stream slot on an upstream connection, in turns by caller connection."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from krproxy.relay.half import Half

__all__ = ["FairQueue", "Waiting"]

Waiting = tuple["Half", bytes, bool]


class FairQueue:
    """Calls waiting for a stream slot, taken in turns by caller connection (round robin): a
    caller with hundreds of calls queued does not make another caller's one call wait behind
    them. The relay's own calls (hooked forwards, plugin and recovery calls) share one turn."""

    def __init__(self) -> None:
        self._queues: dict[object, deque[Waiting]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Waiting]:
        for queue in list(self._queues.values()):
            yield from list(queue)

    @staticmethod
    def _turn(half: Half) -> object:
        client = getattr(half.state, "client", None)
        return client.ep if client is not None else None

    def append(self, entry: Waiting) -> None:
        self._queues.setdefault(self._turn(entry[0]), deque()).append(entry)
        self.count += 1

    def popleft(self) -> Waiting:
        turn = next(iter(self._queues))
        queue = self._queues.pop(turn)
        entry = queue.popleft()
        if queue:
            self._queues[turn] = queue  # back at the end: the next caller's turn comes first
        self.count -= 1
        return entry

    def evict_for(self, half: Half) -> Waiting | None:
        """The queue is full: the latest entry of the caller with the most calls waiting, taken
        out to make room for ``half``; None if ``half``'s caller would then have the most (it
        is the one to be refused)."""
        largest = max(self._queues, key=lambda turn: len(self._queues[turn]))
        queue = self._queues[largest]
        if len(self._queues.get(self._turn(half), ())) + 1 >= len(queue):
            return None
        entry = queue.pop()
        self.count -= 1
        if not queue:
            del self._queues[largest]
        return entry

    def remove(self, half: Half) -> None:
        queue = self._queues.get(self._turn(half))
        if queue is None:
            return
        kept = deque(entry for entry in queue if entry[0] is not half)
        self.count -= len(queue) - len(kept)
        if kept:
            self._queues[self._turn(half)] = kept
        else:
            del self._queues[self._turn(half)]

    def clear(self) -> None:
        self._queues.clear()
        self.count = 0
