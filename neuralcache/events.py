"""The prefetcher's inputs and outputs: access events in, prefetch requests out.

These are the only types the mount exchanges with the prefetcher, so they are plain values with
no behaviour; the link estimate and the cache view are small protocols the caller implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class AccessEvent:
    """One read the mount served (or is about to serve).

    ``stream`` is a hint that groups reads, typically the FUSE file handle; several data-loader
    workers sharing one descriptor share one hint, so the prefetcher separates them itself.
    The event's time is the ``now`` passed alongside it.
    """

    stream: int
    file_id: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PrefetchRequest:
    """Fetch blocks ``[first, first + count)`` of ``file_id`` into the cache ahead of demand.

    ``source`` names the predictor that asked for it; ``need_at`` is when it expects the first
    block to be read (the transport may use it to order prefetches).
    """

    request_id: int
    file_id: int
    first: int
    count: int
    source: str
    issued_at: float
    need_at: float

    @property
    def end(self) -> int:
        """One past the last block."""
        return self.first + self.count


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What the transport currently believes about the path to the hub."""

    bandwidth: float  # bytes per second the prefetches may use (the bottleneck estimate)
    min_rtt: float  # seconds, the propagation round trip without queueing


class CacheView(Protocol):
    """The slice of the block cache the planner may consult (answers must be cheap: no disk I/O).

    A class that subclasses it inherits ``present_until`` and ``absent_until`` as walks over
    ``contains``; the mount walks a stretch in a loop of its own, at about half the cost, since
    the planner asks about every block of every window it guesses (256 per 1 MiB read a
    sequential reader makes).
    """

    def contains(self, file_id: int, block: int) -> bool:
        """True if the block is cached (or already being fetched by demand)."""
        ...

    def present_until(self, file_id: int, first: int, stop: int) -> int:
        """The first block of ``[first, stop)`` that ``contains`` denies, or ``stop``."""
        block = first
        while block < stop and self.contains(file_id, block):
            block += 1
        return block

    def absent_until(self, file_id: int, first: int, stop: int) -> int:
        """The first block of ``[first, stop)`` that ``contains`` confirms, or ``stop``."""
        block = first
        while block < stop and not self.contains(file_id, block):
            block += 1
        return block

    def free_bytes(self) -> int:
        """Bytes the cache can take without evicting anything."""
        ...

    def capacity_bytes(self) -> int:
        """Total cache size in bytes."""
        ...
