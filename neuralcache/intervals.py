"""Sorted, merged sets of block intervals: "which blocks of this file are known present".

The planner consults it before asking the cache block by block: a sequential reader's file is
one interval, so skipping what is already cached or in flight costs one bisection instead of
thousands of cache look-ups.
"""

from __future__ import annotations

import bisect


class IntervalSet:
    """Disjoint half-open integer intervals ``[start, stop)``, sorted and merged."""

    __slots__ = ("_starts", "_stops")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []

    def __len__(self) -> int:
        return len(self._starts)

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._stops))

    def add(self, start: int, stop: int) -> None:
        """Cover ``[start, stop)`` (merging with touching or overlapping intervals)."""
        if stop <= start:
            return
        starts, stops = self._starts, self._stops
        lo = bisect.bisect_left(stops, start)  # first interval that ends at or after start
        hi = bisect.bisect_right(starts, stop)  # intervals before hi start at or before stop
        if lo < hi:
            start = min(start, starts[lo])
            stop = max(stop, stops[hi - 1])
        starts[lo:hi] = [start]
        stops[lo:hi] = [stop]

    def remove(self, start: int, stop: int) -> None:
        """Uncover ``[start, stop)``."""
        if stop <= start:
            return
        starts, stops = self._starts, self._stops
        lo = bisect.bisect_right(stops, start)  # first interval ending after start
        hi = bisect.bisect_left(starts, stop)  # intervals before hi start before stop
        if lo >= hi:
            return
        new_starts, new_stops = [], []
        if starts[lo] < start:
            new_starts.append(starts[lo])
            new_stops.append(start)
        if stops[hi - 1] > stop:
            new_starts.append(stop)
            new_stops.append(stops[hi - 1])
        starts[lo:hi] = new_starts
        stops[lo:hi] = new_stops

    def covers(self, x: int) -> bool:
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._stops[i]

    def next_uncovered(self, x: int) -> int:
        """The smallest value >= ``x`` not covered."""
        i = bisect.bisect_right(self._starts, x) - 1
        if i >= 0 and x < self._stops[i]:
            return self._stops[i]
        return x

    def next_covered(self, x: int, limit: int) -> int:
        """The smallest covered value in ``[x, limit)``, or ``limit`` if there is none."""
        i = bisect.bisect_right(self._starts, x) - 1
        if i >= 0 and x < self._stops[i]:
            return min(x, limit)
        i += 1
        return min(self._starts[i], limit) if i < len(self._starts) else limit

    def uncovered(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of ``[start, stop)`` not covered, in order."""
        out = []
        starts, stops = self._starts, self._stops
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start < stops[i]:
            start = stops[i]
        i += 1
        while start < stop:
            nxt = starts[i] if i < len(starts) else stop
            if nxt > start:
                out.append((start, min(nxt, stop)))
            if i >= len(starts):
                break
            start = max(start, stops[i])
            i += 1
        return out
