"""The hub's per-spoke scheduler, sans-IO: strict priority between classes, deficit round robin
(Shreedhar & Varghese, 1995) between spokes within a class.

Every waiting request is pushed with the spoke it came from, its class (``Priority.DEMAND``
before ``Priority.PREFETCH``) and its cost in bytes. ``pop`` hands out the next one: any demand
request before any prefetch request, and within a class each spoke gets an equal share of
bytes however many requests it queues, so a spoke with a deep prefetch queue cannot starve
one asking for a little. Nothing here touches a clock or a socket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_QUANTUM = 256 * 1024
"""Bytes a spoke's deficit grows by per round: a few requests' worth, so a round is short
(latency) yet a 4 MiB request needs only a few rounds to become affordable."""


class _Class(Generic[T]):
    """One priority class: a FIFO per spoke and the DRR round over spokes with work."""

    def __init__(self) -> None:
        self.queues: dict[Hashable, deque[tuple[int, T]]] = {}
        self.active: deque[Hashable] = deque()  # spokes with queued work, in round order
        self.deficit: dict[Hashable, int] = {}

    def push(self, spoke: Hashable, cost: int, item: T) -> None:
        queue = self.queues.get(spoke)
        if queue is None:
            queue = self.queues[spoke] = deque()
            self.active.append(spoke)
            self.deficit[spoke] = 0
        queue.append((cost, item))

    def pop(self, quantum: int) -> T | None:
        while self.active:
            spoke = self.active[0]
            queue = self.queues[spoke]
            cost, item = queue[0]
            if self.deficit[spoke] >= cost:
                self.deficit[spoke] -= cost
                queue.popleft()
                if not queue:
                    self._forget(spoke)
                return item
            self.deficit[spoke] += quantum  # this spoke's next turn; the others go first
            self.active.rotate(-1)
        return None

    def remove(self, spoke: Hashable, item: T) -> bool:
        queue = self.queues.get(spoke)
        if queue is None:
            return False
        for entry in queue:
            if entry[1] is item:
                queue.remove(entry)
                if not queue:
                    self._forget(spoke)
                return True
        return False

    def _forget(self, spoke: Hashable) -> None:
        # An idle spoke keeps no credit (DRR): it cannot save up a burst while it waits.
        del self.queues[spoke]
        del self.deficit[spoke]
        self.active.remove(spoke)


class FairQueue(Generic[T]):
    """Requests waiting for the hub, ordered by class, then fairly across spokes."""

    def __init__(self, priorities: int = 2, *, quantum: int = DEFAULT_QUANTUM) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum must be positive, got {quantum}")
        self._classes: list[_Class[T]] = [_Class() for _ in range(priorities)]
        self._quantum = quantum
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, spoke: Hashable, priority: int, cost: int, item: T) -> None:
        """Queue ``item`` from ``spoke`` at ``priority`` (0 is served first), costing ``cost``."""
        if cost < 0:
            raise ValueError(f"cost must not be negative, got {cost}")
        self._classes[priority].push(spoke, cost, item)
        self._len += 1

    def pop(self) -> T | None:
        """The next item to serve, or None if nothing waits."""
        for cls in self._classes:
            item = cls.pop(self._quantum)
            if item is not None:
                self._len -= 1
                return item
        return None

    def remove(self, spoke: Hashable, priority: int, item: T) -> bool:
        """Withdraw a queued ``item`` (its requester went away); False if it was not queued."""
        removed = self._classes[priority].remove(spoke, item)
        self._len -= removed
        return removed
